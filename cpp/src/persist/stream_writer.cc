#include "nebulite/stream_writer.h"

#include <algorithm>
#include <cstring>

#include "nebulite/crc32.h"

namespace nebulite {

Result<ManifestFile> StreamToFile(Storage* storage, const std::string& path,
                                  const std::string& name, const format::ArchiveLayout& layout,
                                  const std::vector<SourceRecord>& records, uint8_t* buf,
                                  uint64_t window, CopyEngine& copy) {
  if (window == 0 || window % 4096 != 0 || reinterpret_cast<uintptr_t>(buf) % 4096 != 0)
    return Status::InvalidArgument("the streaming window must be 4 KiB aligned");
  const auto& place = layout.records();
  if (records.size() != place.size())
    return Status::InvalidArgument("records do not match the layout");
  NEBULITE_ASSIGN_OR_RETURN(auto file, storage->NewWritableFile(path, layout.file_size()));
  std::vector<std::string> headers;
  for (size_t i = 0; i < place.size(); ++i) headers.push_back(layout.LocalHeader(i, 0));
  std::vector<uint32_t> crcs(place.size(), 0);
  uint64_t end = layout.tail_offset();
  size_t first = 0;  // first record that may overlap the window
  for (uint64_t w0 = 0; w0 < end; w0 += window) {
    uint64_t w1 = std::min(end, w0 + window);
    std::vector<CopySpan> spans;
    while (first < place.size() && place[first].data_offset + place[first].size <= w0) ++first;
    for (size_t i = first; i < place.size() && place[i].header_offset < w1; ++i) {
      uint64_t h0 = std::max(w0, place[i].header_offset), h1 = std::min(w1, place[i].data_offset);
      if (h0 < h1)
        std::memcpy(buf + (h0 - w0), headers[i].data() + (h0 - place[i].header_offset), h1 - h0);
      uint64_t p0 = std::max(w0, place[i].data_offset),
               p1 = std::min(w1, place[i].data_offset + place[i].size);
      if (p0 < p1)
        spans.push_back({buf + (p0 - w0),
                         static_cast<const uint8_t*>(records[i].data) + (p0 - place[i].data_offset),
                         p1 - p0});
    }
    copy.Copy(spans, /*bypass_caches=*/false);  // the CRC below reads it back at once
    for (size_t i = first; i < place.size() && place[i].header_offset < w1; ++i) {
      uint64_t p0 = std::max(w0, place[i].data_offset),
               p1 = std::min(w1, place[i].data_offset + place[i].size);
      if (p0 < p1) crcs[i] = Crc32(crcs[i], buf + (p0 - w0), p1 - p0);
    }
    NEBULITE_RETURN_IF_ERROR(file->WriteAt(w0, buf, w1 - w0));
  }
  for (size_t i = 0; i < place.size(); ++i) {
    std::string h = layout.LocalHeader(i, crcs[i]);
    NEBULITE_RETURN_IF_ERROR(file->WriteAt(place[i].header_offset, h.data(), h.size()));
  }
  NEBULITE_ASSIGN_OR_RETURN(std::string tail, layout.Tail(crcs));
  NEBULITE_RETURN_IF_ERROR(file->WriteAt(layout.tail_offset(), tail.data(), tail.size()));
  NEBULITE_RETURN_IF_ERROR(file->Sync());
  NEBULITE_RETURN_IF_ERROR(file->Close());
  return ManifestFile{name, layout.file_size(), DataFileCrc(layout, crcs, tail)};
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
