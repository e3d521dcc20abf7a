// The data-file writer; the protocol is at the top of nebulite/data_file_writer.h.
#include "nebulite/data_file_writer.h"

#include <algorithm>
#include <cstring>

#include "nebulite/crc32.h"

namespace nebulite {
namespace {

constexpr uint64_t kChunk = 16ull << 20;  // unit of parallel writing (4 KiB aligned)

// A part of a file checksummed on its own: a record's local header or payload, or the
// tail. The regions tile the file in order.
struct Region {
  uint64_t offset = 0, size = 0;
  int record = -1;  // the record whose payload this is; -1 for headers and the tail
};

std::vector<Region> Regions(const format::ArchiveLayout& layout) {
  std::vector<Region> out;
  const auto& place = layout.records();
  for (size_t i = 0; i < place.size(); ++i) {
    out.push_back({place[i].header_offset, place[i].data_offset - place[i].header_offset, -1});
    if (place[i].size > 0) out.push_back({place[i].data_offset, place[i].size, int(i)});
  }
  out.push_back({layout.tail_offset(), layout.file_size() - layout.tail_offset(), -1});
  return out;
}

// Running checksums of a file being written in order.
struct Checksums {
  explicit Checksums(size_t records) : record(records, 0) {}
  std::vector<uint32_t> record;  // per record: CRC-32 of its payload
  uint32_t file = 0;             // CRC-32 of every byte so far
};

// Writes the n bytes at `data` as file bytes [offset, offset + n), in kChunk pieces on
// `io`, checksumming every region piece they hold; `sums` is extended in file order.
// With no `file`, only checksums.
Status WriteChunks(WritableFile* file, uint64_t offset, const uint8_t* data, uint64_t n,
                   const std::vector<Region>& regions, CopyEngine* io, Checksums* sums) {
  struct Piece {
    int record;
    uint64_t len;
    uint32_t crc;
  };
  const size_t nchunks = (n + kChunk - 1) / kChunk;
  std::vector<std::vector<Piece>> pieces(nchunks);
  std::vector<Status> status(nchunks);
  auto work = [&](size_t c) {
    const uint64_t c0 = offset + c * kChunk, c1 = std::min(offset + n, c0 + kChunk);
    auto it =
        std::upper_bound(regions.begin(), regions.end(), c0,
                         [](uint64_t off, const Region& r) { return off < r.offset + r.size; });
    for (; it != regions.end() && it->offset < c1; ++it) {
      const uint64_t p0 = std::max(c0, it->offset), p1 = std::min(c1, it->offset + it->size);
      if (p0 < p1)
        pieces[c].push_back({it->record, p1 - p0, Crc32(0, data + (p0 - offset), p1 - p0)});
    }
    if (file != nullptr) status[c] = file->WriteAt(c0, data + (c0 - offset), c1 - c0);
  };
  if (io != nullptr) {
    io->ParallelFor(nchunks, work);
  } else {
    for (size_t c = 0; c < nchunks; ++c) work(c);
  }
  for (const Status& st : status) NEBULITE_RETURN_IF_ERROR(st);
  for (const auto& chunk : pieces) {
    for (const Piece& p : chunk) {
      if (p.record >= 0)
        sums->record[p.record] = Crc32Combine(sums->record[p.record], p.crc, p.len);
      sums->file = Crc32Combine(sums->file, p.crc, p.len);
    }
  }
  return Status::OK();
}

// CRC-32 of each record's payload, read from `records` in kChunk pieces on `io`.
std::vector<uint32_t> RecordCrcs(const format::ArchiveLayout& layout,
                                 const std::vector<SourceRecord>& records, CopyEngine* io) {
  struct Piece {
    size_t record;
    uint64_t offset, len;
    uint32_t crc = 0;
  };
  std::vector<Piece> pieces;
  const auto& place = layout.records();
  for (size_t i = 0; i < place.size(); ++i)
    for (uint64_t off = 0; off < place[i].size; off += kChunk)
      pieces.push_back({i, off, std::min(kChunk, place[i].size - off)});
  auto work = [&](size_t k) {
    Piece& p = pieces[k];
    p.crc = Crc32(0, static_cast<const uint8_t*>(records[p.record].data) + p.offset, p.len);
  };
  if (io != nullptr) {
    io->ParallelFor(pieces.size(), work);
  } else {
    for (size_t k = 0; k < pieces.size(); ++k) work(k);
  }
  std::vector<uint32_t> crcs(place.size(), 0);
  for (const Piece& p : pieces) crcs[p.record] = Crc32Combine(crcs[p.record], p.crc, p.len);
  return crcs;
}

// Stores that write whole files (object stores): `pieces` become the data file at its
// final name in one call; it appears complete or not at all.
Result<ManifestFile> PublishWhole(Storage* storage, const DataFileId& id, uint64_t size,
                                  const std::vector<ByteSpan>& pieces, uint32_t crc) {
  NEBULITE_RETURN_IF_ERROR(
      storage->WriteWholeFile(DataFilePath(id.tag, id.version, id.rank, id.name), pieces));
  return ManifestFile{id.name, size, crc};
}

// Steps 1 and 3-4 of the protocol around `write` (step 2).
template <typename Fn>
Result<ManifestFile> WriteAndPublish(Storage* storage, const DataFileId& id, uint64_t size,
                                     Fn&& write) {
  const std::string temp = TempDataFilePath(id.tag, id.version, id.rank, id.name);
  NEBULITE_ASSIGN_OR_RETURN(std::unique_ptr<WritableFile> file,
                            storage->NewWritableFile(temp, size));
  Result<uint32_t> crc = write(file.get());
  Status st = crc.status();
  if (st.ok()) st = file->Sync();
  Status closed = file->Close();
  if (st.ok()) st = closed;
  if (st.ok()) st = storage->Rename(temp, DataFilePath(id.tag, id.version, id.rank, id.name));
  if (!st.ok()) {
    (void)storage->Delete(temp);  // never visible: it had no final name yet
    return st;
  }
  return ManifestFile{id.name, size, *crc};
}

}  // namespace

Result<ManifestFile> DataFileWriter::WriteImage(const DataFileId& id,
                                                const format::ArchiveLayout& layout,
                                                const uint8_t* image,
                                                const std::vector<uint32_t>& crcs) {
  const auto& place = layout.records();
  if (crcs.size() != place.size()) return Status::InvalidArgument("CRCs do not match the layout");
  const std::vector<Region> regions = Regions(layout);
  NEBULITE_ASSIGN_OR_RETURN(std::string tail, layout.Tail(crcs));
  const uint32_t expected = DataFileCrc(layout, crcs, tail);
  auto check = [&](const Checksums& sums) -> Status {
    for (size_t i = 0; i < place.size(); ++i) {
      if (sums.record[i] != crcs[i]) {
        return Status::Corruption("record '" + place[i].name + "' of '" + id.name +
                                  "' changed in memory after it was saved (its CRC-32 differs "
                                  "from the one computed while it was staged)");
      }
    }
    if (sums.file != expected) {
      return Status::Corruption("the headers of '" + id.name +
                                "' changed in memory after it was saved");
    }
    return Status::OK();
  };
  if (storage_->is_object_store()) {  // checked first, then uploaded straight from memory
    Checksums sums(place.size());
    NEBULITE_RETURN_IF_ERROR(
        WriteChunks(nullptr, 0, image, layout.file_size(), regions, io_, &sums));
    NEBULITE_RETURN_IF_ERROR(check(sums));
    return PublishWhole(storage_, id, layout.file_size(), {{image, layout.file_size()}},
                        expected);
  }
  return WriteAndPublish(
      storage_, id, layout.file_size(), [&](WritableFile* file) -> Result<uint32_t> {
        Checksums sums(place.size());
        NEBULITE_RETURN_IF_ERROR(
            WriteChunks(file, 0, image, layout.file_size(), regions, io_, &sums));
        NEBULITE_RETURN_IF_ERROR(check(sums));
        return sums.file;
      });
}

Result<ManifestFile> DataFileWriter::WriteStreamed(const DataFileId& id,
                                                   const format::ArchiveLayout& layout,
                                                   const std::vector<SourceRecord>& records,
                                                   uint8_t* buf, uint64_t window,
                                                   CopyEngine& copy) {
  if (window == 0 || window % 4096 != 0 || reinterpret_cast<uintptr_t>(buf) % 4096 != 0)
    return Status::InvalidArgument("the streaming window must be 4 KiB aligned");
  const auto& place = layout.records();
  if (records.size() != place.size())
    return Status::InvalidArgument("records do not match the layout");
  const std::vector<Region> regions = Regions(layout);
  if (storage_->is_object_store()) {
    // The records' CRCs first, so that the headers are final: the file is uploaded in one
    // pass, from the records themselves, with no window.
    const std::vector<uint32_t> crcs = RecordCrcs(layout, records, io_);
    std::vector<std::string> headers;
    for (size_t i = 0; i < place.size(); ++i) headers.push_back(layout.LocalHeader(i, crcs[i]));
    NEBULITE_ASSIGN_OR_RETURN(std::string tail, layout.Tail(crcs));
    std::vector<ByteSpan> pieces;
    for (size_t i = 0; i < place.size(); ++i) {
      pieces.push_back({headers[i].data(), headers[i].size()});
      pieces.push_back({records[i].data, static_cast<size_t>(place[i].size)});
    }
    pieces.push_back({tail.data(), tail.size()});
    return PublishWhole(storage_, id, layout.file_size(), pieces,
                        DataFileCrc(layout, crcs, tail));
  }
  return WriteAndPublish(
      storage_, id, layout.file_size(), [&](WritableFile* file) -> Result<uint32_t> {
        std::vector<std::string> headers;
        for (size_t i = 0; i < place.size(); ++i) headers.push_back(layout.LocalHeader(i, 0));
        Checksums sums(place.size());
        const uint64_t end = layout.tail_offset();
        size_t first = 0;  // first record that may overlap the window
        for (uint64_t w0 = 0; w0 < end; w0 += window) {
          const uint64_t w1 = std::min(end, w0 + window);
          std::vector<CopySpan> spans;
          while (first < place.size() && place[first].data_offset + place[first].size <= w0)
            ++first;
          for (size_t i = first; i < place.size() && place[i].header_offset < w1; ++i) {
            uint64_t h0 = std::max(w0, place[i].header_offset),
                     h1 = std::min(w1, place[i].data_offset);
            if (h0 < h1)
              std::memcpy(buf + (h0 - w0), headers[i].data() + (h0 - place[i].header_offset),
                          h1 - h0);
            uint64_t p0 = std::max(w0, place[i].data_offset),
                     p1 = std::min(w1, place[i].data_offset + place[i].size);
            if (p0 < p1)
              spans.push_back(
                  {buf + (p0 - w0),
                   static_cast<const uint8_t*>(records[i].data) + (p0 - place[i].data_offset),
                   p1 - p0});
          }
          copy.Copy(spans);
          NEBULITE_RETURN_IF_ERROR(WriteChunks(file, w0, buf, w1 - w0, regions, io_, &sums));
        }
        // The headers again, now with their CRCs, and the central directory.
        for (size_t i = 0; i < place.size(); ++i) {
          std::string h = layout.LocalHeader(i, sums.record[i]);
          NEBULITE_RETURN_IF_ERROR(file->WriteAt(place[i].header_offset, h.data(), h.size()));
        }
        NEBULITE_ASSIGN_OR_RETURN(std::string tail, layout.Tail(sums.record));
        NEBULITE_RETURN_IF_ERROR(file->WriteAt(layout.tail_offset(), tail.data(), tail.size()));
        return DataFileCrc(layout, sums.record, tail);
      });
}

Result<uint32_t> FinishImage(const format::ArchiveLayout& layout, uint8_t* image,
                             const std::vector<uint32_t>& crcs) {
  const auto& place = layout.records();
  if (crcs.size() != place.size()) return Status::InvalidArgument("CRCs do not match the layout");
  for (size_t i = 0; i < place.size(); ++i) {
    std::string h = layout.LocalHeader(i, crcs[i]);
    std::memcpy(image + place[i].header_offset, h.data(), h.size());
  }
  NEBULITE_ASSIGN_OR_RETURN(std::string tail, layout.Tail(crcs));
  std::memcpy(image + layout.tail_offset(), tail.data(), tail.size());
  return DataFileCrc(layout, crcs, tail);
}

uint32_t DataFileCrc(const format::ArchiveLayout& layout, const std::vector<uint32_t>& crcs,
                     const std::string& tail) {
  uint32_t c = 0;
  const auto& place = layout.records();
  for (size_t i = 0; i < place.size(); ++i) {
    std::string h = layout.LocalHeader(i, crcs[i]);
    c = Crc32(c, h.data(), h.size());
    c = Crc32Combine(c, crcs[i], place[i].size);
  }
  return Crc32(c, tail.data(), tail.size());
}

}  // namespace nebulite
