#include "nebulite/stored_archive.h"

#include <algorithm>
#include <atomic>
#include <thread>
#include <vector>

#include "nebulite/crc32.h"

namespace nebulite {

Result<std::unique_ptr<StoredArchive>> StoredArchive::Open(Storage* storage,
                                                           const std::string& path) {
  Result<std::unique_ptr<ReadableFile>> opened = storage->NewReadableFile(path);
  if (!opened.ok()) {
    if (opened.status().code() == StatusCode::kInvalidArgument) {  // not a regular file
      return Status::Corruption(path + ": " + opened.status().message());
    }
    return opened.status();
  }
  std::unique_ptr<ReadableFile> file = std::move(opened).value();
  ReadableFile* f = file.get();
  auto read_at = [f](uint64_t off, size_t n, void* dst) { return f->ReadAt(off, n, dst); };
  auto index = format::ArchiveIndex::Parse(f->size(), read_at);
  if (!index.ok()) return index.status().WithContext(path);
  return std::unique_ptr<StoredArchive>(
      new StoredArchive(std::move(file), path, std::move(index).value()));
}

Status StoredArchive::ReadInto(const format::RecordEntry& e, void* dst, int threads) const {
  constexpr uint64_t kPiece = 16ull << 20;
  size_t pieces = std::max<uint64_t>(1, (e.size + kPiece - 1) / kPiece);
  std::vector<uint32_t> crcs(pieces, 0);
  std::vector<Status> status(pieces);
  auto work = [&](size_t i) {
    uint64_t off = i * kPiece, n = std::min<uint64_t>(kPiece, e.size - std::min(e.size, off));
    if (n == 0) return;
    uint8_t* p = static_cast<uint8_t*>(dst) + off;
    auto got = file_->ReadAt(e.data_offset + off, n, p);
    if (!got.ok()) {
      status[i] = got.status();
      return;
    }
    if (*got != n) {
      status[i] = Status::Corruption(path_ + ": record '" + e.name + "' is truncated");
      return;
    }
    crcs[i] = Crc32(0, p, n);
  };
  int t = std::max(1, std::min<int>(threads, static_cast<int>(pieces)));
  if (t == 1) {
    for (size_t i = 0; i < pieces; ++i) work(i);
  } else {
    std::vector<std::thread> pool;
    std::atomic<size_t> next{0};
    for (int k = 0; k < t; ++k)
      pool.emplace_back([&] {
        for (size_t i; (i = next.fetch_add(1)) < pieces;) work(i);
      });
    for (auto& th : pool) th.join();
  }
  uint32_t crc = 0;
  for (size_t i = 0; i < pieces; ++i) {
    NEBULITE_RETURN_IF_ERROR(status[i]);
    uint64_t off = i * kPiece, n = std::min<uint64_t>(kPiece, e.size - std::min(e.size, off));
    crc = Crc32Combine(crc, crcs[i], n);
  }
  if (crc != e.crc32) {
    return Status::Corruption(path_ + ": checksum mismatch in record '" + e.name + "'");
  }
  return Status::OK();
}

}  // namespace nebulite
