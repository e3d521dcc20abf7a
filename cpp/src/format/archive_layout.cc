// ArchiveLayout: where every byte of a nebulite data file goes (docs/format.md).
//
// For each record, in the given order:
//   local header (30 bytes) | "archive/<name>" | [zip64 extra] | padding extra "NB" | payload
// with the padding extra sized so that the payload starts on a kAlignment boundary.
// Then the tail: the central directory, the zip64 end records when needed, and the
// end-of-central-directory record. Everything is deterministic (fixed DOS time).
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "format/zip.h"
#include "nebulite/format.h"

namespace nebulite::format {
namespace {

using namespace zip;  // NOLINT(build/namespaces): the record constants read better bare.

bool CheckedAdd(uint64_t a, uint64_t b, uint64_t* out) {
  return !__builtin_add_overflow(a, b, out);
}

// Smallest multiple of kAlignment >= v; false on overflow.
bool AlignUp(uint64_t v, uint64_t* out) {
  uint64_t t;
  if (!CheckedAdd(v, kAlignment - 1, &t)) return false;
  *out = t & ~(kAlignment - 1);
  return true;
}

uint64_t FullNameSize(const RecordPlacement& r) {
  return kArchivePrefix.size() + 1 + r.name.size();
}

// The local header carries a zip64 extra (both sizes) only when the size overflows.
bool LocalNeedsZip64(const RecordPlacement& r) { return r.size >= kMax32; }
uint64_t LocalZip64ExtraSize(const RecordPlacement& r) {
  return LocalNeedsZip64(r) ? kExtraHeaderSize + 16 : 0;
}

// The central header's zip64 extra holds exactly the overflowing fields, in APPNOTE order.
uint64_t CentralZip64ExtraSize(const RecordPlacement& r) {
  uint64_t fields = (r.size >= kMax32 ? 2 : 0) + (r.header_offset >= kMax32 ? 1 : 0);
  return fields == 0 ? 0 : kExtraHeaderSize + 8 * fields;
}

bool RecordNeedsZip64(const RecordPlacement& r) { return CentralZip64ExtraSize(r) != 0; }

uint16_t VersionNeeded(const RecordPlacement& r) {
  return RecordNeedsZip64(r) ? kVersionNeededZip64 : kVersionNeeded;
}

uint32_t Clamp32(uint64_t v) { return v >= kMax32 ? kMax32 : static_cast<uint32_t>(v); }

}  // namespace

Result<ArchiveLayout> ArchiveLayout::Plan(const std::vector<RecordSpec>& records) {
  if (records.empty()) return Status::InvalidArgument("archive needs at least one record");
  if (records.size() > kMaxRecords) {
    return Status::InvalidArgument("too many records: " + std::to_string(records.size()) + " > " +
                                   std::to_string(kMaxRecords));
  }
  std::set<std::string_view> names;
  ArchiveLayout layout;
  layout.records_.reserve(records.size());
  uint64_t offset = 0;
  uint64_t cd_size = 0;
  for (const RecordSpec& spec : records) {
    if (spec.name.empty()) return Status::InvalidArgument("empty record name");
    if (spec.name.size() > kMaxRecordNameLength) {
      return Status::InvalidArgument("record name longer than " +
                                     std::to_string(kMaxRecordNameLength) + " bytes");
    }
    if (!names.insert(spec.name).second) {
      return Status::InvalidArgument("duplicate record name: " + spec.name);
    }
    RecordPlacement r;
    r.name = spec.name;
    r.size = spec.size;
    r.header_offset = offset;
    const uint64_t fixed =
        kLocalHeaderSize + FullNameSize(r) + LocalZip64ExtraSize(r) + kExtraHeaderSize;
    uint64_t min_data;
    if (!CheckedAdd(offset, fixed, &min_data) || !AlignUp(min_data, &r.data_offset) ||
        !CheckedAdd(r.data_offset, r.size, &offset)) {
      return Status::InvalidArgument("archive size overflows 64 bits at record " + spec.name);
    }
    cd_size += kCentralHeaderSize + FullNameSize(r) + CentralZip64ExtraSize(r);
    layout.records_.push_back(std::move(r));
  }
  layout.tail_offset_ = offset;
  const bool zip64_end =
      records.size() >= kMax16 || layout.tail_offset_ >= kMax32 || cd_size >= kMax32;
  const uint64_t tail_size = cd_size +
                             (zip64_end ? kZip64EndOfCentralDirSize + kZip64LocatorSize : 0) +
                             kEndOfCentralDirSize;
  if (!CheckedAdd(layout.tail_offset_, tail_size, &layout.file_size_)) {
    return Status::InvalidArgument("archive size overflows 64 bits");
  }
  return layout;
}

std::string ArchiveLayout::LocalHeader(size_t i, uint32_t crc) const {
  if (i >= records_.size()) return {};
  const RecordPlacement& r = records_[i];
  const uint64_t head = kLocalHeaderSize + FullNameSize(r) + LocalZip64ExtraSize(r);
  const uint64_t pad = r.data_offset - r.header_offset - head - kExtraHeaderSize;
  const uint64_t extra_len = LocalZip64ExtraSize(r) + kExtraHeaderSize + pad;
  std::string h;
  h.reserve(r.data_offset - r.header_offset);
  Put32(&h, kLocalHeaderSig);
  Put16(&h, VersionNeeded(r));
  Put16(&h, 0);  // flags: no data descriptor, not encrypted
  Put16(&h, 0);  // method: stored
  Put16(&h, kDosTime);
  Put16(&h, kDosDate);
  Put32(&h, crc);
  Put32(&h, Clamp32(r.size));  // compressed
  Put32(&h, Clamp32(r.size));  // uncompressed
  Put16(&h, static_cast<uint16_t>(FullNameSize(r)));
  Put16(&h, static_cast<uint16_t>(extra_len));
  h.append(kArchivePrefix);
  h.push_back('/');
  h.append(r.name);
  if (LocalNeedsZip64(r)) {
    Put16(&h, kZip64ExtraId);
    Put16(&h, 16);
    Put64(&h, r.size);  // uncompressed
    Put64(&h, r.size);  // compressed
  }
  Put16(&h, kPaddingExtraId);
  Put16(&h, static_cast<uint16_t>(pad));
  h.append(pad, '\0');
  return h;
}

Result<std::string> ArchiveLayout::Tail(const std::vector<uint32_t>& crcs) const {
  if (crcs.size() != records_.size()) {
    return Status::InvalidArgument("Tail: got " + std::to_string(crcs.size()) + " crcs for " +
                                   std::to_string(records_.size()) + " records");
  }
  std::string t;
  t.reserve(file_size_ - tail_offset_);
  for (size_t i = 0; i < records_.size(); ++i) {
    const RecordPlacement& r = records_[i];
    Put32(&t, kCentralHeaderSig);
    Put16(&t, VersionNeeded(r));  // version made by: MS-DOS host, same spec version
    Put16(&t, VersionNeeded(r));
    Put16(&t, 0);  // flags
    Put16(&t, 0);  // method: stored
    Put16(&t, kDosTime);
    Put16(&t, kDosDate);
    Put32(&t, crcs[i]);
    Put32(&t, Clamp32(r.size));
    Put32(&t, Clamp32(r.size));
    Put16(&t, static_cast<uint16_t>(FullNameSize(r)));
    Put16(&t, static_cast<uint16_t>(CentralZip64ExtraSize(r)));
    Put16(&t, 0);  // comment length
    Put16(&t, 0);  // disk number start
    Put16(&t, 0);  // internal attributes
    Put32(&t, 0);  // external attributes
    Put32(&t, Clamp32(r.header_offset));
    t.append(kArchivePrefix);
    t.push_back('/');
    t.append(r.name);
    if (RecordNeedsZip64(r)) {
      Put16(&t, kZip64ExtraId);
      Put16(&t, static_cast<uint16_t>(CentralZip64ExtraSize(r) - kExtraHeaderSize));
      if (r.size >= kMax32) {
        Put64(&t, r.size);  // uncompressed
        Put64(&t, r.size);  // compressed
      }
      if (r.header_offset >= kMax32) Put64(&t, r.header_offset);
    }
  }
  const uint64_t cd_size = t.size();
  const uint64_t n = records_.size();
  if (n >= kMax16 || tail_offset_ >= kMax32 || cd_size >= kMax32) {
    const uint64_t zip64_end_offset = tail_offset_ + cd_size;
    Put32(&t, kZip64EndOfCentralDirSig);
    Put64(&t, kZip64EndOfCentralDirSize - 12);  // size of the rest of this record
    Put16(&t, kVersionNeededZip64);             // version made by
    Put16(&t, kVersionNeededZip64);             // version needed
    Put32(&t, 0);                               // this disk
    Put32(&t, 0);                               // disk with the central directory
    Put64(&t, n);                               // entries on this disk
    Put64(&t, n);                               // entries in total
    Put64(&t, cd_size);
    Put64(&t, tail_offset_);
    Put32(&t, kZip64LocatorSig);
    Put32(&t, 0);  // disk with the zip64 end record
    Put64(&t, zip64_end_offset);
    Put32(&t, 1);  // total disks
  }
  Put32(&t, kEndOfCentralDirSig);
  Put16(&t, 0);  // this disk
  Put16(&t, 0);  // disk with the central directory
  Put16(&t, static_cast<uint16_t>(n >= kMax16 ? kMax16 : n));
  Put16(&t, static_cast<uint16_t>(n >= kMax16 ? kMax16 : n));
  Put32(&t, Clamp32(cd_size));
  Put32(&t, Clamp32(tail_offset_));
  Put16(&t, 0);  // comment length
  if (t.size() != file_size_ - tail_offset_) {
    return Status::Internal("Tail: size disagrees with the plan");
  }
  return t;
}

}  // namespace nebulite::format
