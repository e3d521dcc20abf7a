#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "format/zip.h"
#include "nebulite/crc32.h"
#include "nebulite/format.h"

namespace nebulite::format {
namespace {

// Deterministic payload bytes for record `seed`.
std::string Payload(uint64_t size, uint32_t seed) {
  std::string s(size, '\0');
  uint32_t x = seed * 2654435761u + 1;
  for (auto& c : s) {
    x = x * 1103515245u + 12345u;
    c = static_cast<char>(x >> 16);
  }
  return s;
}

ReadAtFn StringReader(const std::string* image) {
  return [image](uint64_t offset, size_t n, void* dst) -> Result<size_t> {
    if (offset > image->size()) return size_t{0};
    const size_t k = std::min<uint64_t>(n, image->size() - offset);
    std::memcpy(dst, image->data() + offset, k);
    return k;
  };
}

Result<ArchiveIndex> ParseImage(const std::string& image) {
  return ArchiveIndex::Parse(image.size(), StringReader(&image));
}

// Lays out `specs` and writes the whole image, checking that the pieces tile the file.
std::string BuildImage(const std::vector<RecordSpec>& specs, ArchiveLayout* layout_out = nullptr) {
  auto layout = ArchiveLayout::Plan(specs);
  EXPECT_TRUE(layout.ok()) << layout.status().ToString();
  std::string image;
  std::vector<uint32_t> crcs;
  for (size_t i = 0; i < specs.size(); ++i) {
    const RecordPlacement& r = layout->records()[i];
    const std::string payload = Payload(r.size, static_cast<uint32_t>(i));
    const uint32_t crc = Crc32(0, payload.data(), payload.size());
    crcs.push_back(crc);
    EXPECT_EQ(image.size(), r.header_offset) << "hole before record " << i;
    const std::string header = layout->LocalHeader(i, crc);
    EXPECT_EQ(header.size(), r.data_offset - r.header_offset);
    image += header;
    EXPECT_EQ(image.size() % kAlignment, 0u);
    image += payload;
  }
  EXPECT_EQ(image.size(), layout->tail_offset());
  auto tail = layout->Tail(crcs);
  EXPECT_TRUE(tail.ok()) << tail.status().ToString();
  image += *tail;
  EXPECT_EQ(image.size(), layout->file_size());
  if (layout_out != nullptr) *layout_out = *layout;
  return image;
}

std::vector<RecordSpec> TorchLikeSpecs() {
  return {{"data.pkl", 517},
          {".format_version", 1},
          {".storage_alignment", 4},
          {"byteorder", 6},
          {"data/0", 4096 * 3},
          {"data/1", 0},
          {"data/2", 1},
          {"data/3", 4097},
          {"version", 2},
          {".data/serialization_id", 40},
          {std::string(kIndexRecord), 150}};
}

void ExpectRoundTrip(const std::vector<RecordSpec>& specs) {
  ArchiveLayout layout;
  const std::string image = BuildImage(specs, &layout);
  auto index = ParseImage(image);
  ASSERT_TRUE(index.ok()) << index.status().ToString();
  EXPECT_EQ(index->prefix(), kArchivePrefix);
  ASSERT_EQ(index->records().size(), specs.size());
  for (size_t i = 0; i < specs.size(); ++i) {
    const RecordEntry& e = index->records()[i];
    EXPECT_EQ(e.name, specs[i].name);
    EXPECT_EQ(e.size, specs[i].size);
    EXPECT_EQ(e.data_offset, layout.records()[i].data_offset);
    EXPECT_EQ(e.data_offset % kAlignment, 0u);
    const std::string payload = Payload(e.size, static_cast<uint32_t>(i));
    EXPECT_EQ(image.compare(e.data_offset, e.size, payload), 0);
    EXPECT_EQ(e.crc32, Crc32(0, payload.data(), payload.size()));
    const RecordEntry* found = index->Find(specs[i].name);
    ASSERT_NE(found, nullptr);
    EXPECT_EQ(found->data_offset, e.data_offset);
  }
  EXPECT_EQ(index->Find("nope"), nullptr);
  EXPECT_EQ(index->Find("archive/data.pkl"), nullptr);
}

TEST(ArchiveLayoutTest, RoundTripTorchLike) { ExpectRoundTrip(TorchLikeSpecs()); }

TEST(ArchiveLayoutTest, RoundTripSmallAndEmptyRecords) {
  ExpectRoundTrip({{"a", 0}});
  ExpectRoundTrip({{"a", 1}});
  ExpectRoundTrip({{"a", 0}, {"b", 0}, {"c", 1}, {"d", 0}});
}

TEST(ArchiveLayoutTest, RoundTripManyRecords) {
  std::vector<RecordSpec> specs;
  for (int i = 0; i < 3000; ++i) specs.push_back({"data/" + std::to_string(i), uint64_t(i % 7)});
  ExpectRoundTrip(specs);
}

TEST(ArchiveLayoutTest, RoundTripNames) {
  // Names of every length around the padding boundary, and at the limit.
  std::vector<RecordSpec> specs;
  for (size_t len = 1; len < 80; ++len) specs.push_back({std::string(len, 'x'), len});
  specs.push_back({std::string(kMaxRecordNameLength, 'y'), 3});
  specs.push_back({"with/many/slashes/and spaces \xC3\xA9", 5});
  ExpectRoundTrip(specs);
}

TEST(ArchiveLayoutTest, PaddingExtraIsAtLeastItsHeader) {
  // A name that would make the payload land exactly on a boundary without padding
  // still gets a (4096-byte) padding extra field.
  for (size_t len = 4096 - 30 - 8 - 8; len <= 4096 - 30 - 8; ++len) {
    auto layout = ArchiveLayout::Plan({{std::string(len, 'n'), 1}});
    ASSERT_TRUE(layout.ok());
    const RecordPlacement& r = layout->records()[0];
    EXPECT_GE(r.data_offset - r.header_offset, 30 + 8 + len + 4);
    EXPECT_EQ(r.data_offset % kAlignment, 0u);
  }
}

TEST(ArchiveLayoutTest, NoHolesInvariant) {
  auto layout = ArchiveLayout::Plan(TorchLikeSpecs());
  ASSERT_TRUE(layout.ok());
  uint64_t at = 0;
  for (const RecordPlacement& r : layout->records()) {
    EXPECT_EQ(r.header_offset, at);
    EXPECT_EQ(r.data_offset % kAlignment, 0u);
    EXPECT_GT(r.data_offset, r.header_offset);
    EXPECT_LE(r.data_offset - r.header_offset, 30 + 8 + r.name.size() + 4 + kAlignment);
    at = r.data_offset + r.size;
  }
  EXPECT_EQ(layout->tail_offset(), at);
  std::vector<uint32_t> crcs(layout->records().size(), 0);
  auto tail = layout->Tail(crcs);
  ASSERT_TRUE(tail.ok());
  EXPECT_EQ(layout->tail_offset() + tail->size(), layout->file_size());
}

TEST(ArchiveLayoutTest, Deterministic) {
  EXPECT_EQ(BuildImage(TorchLikeSpecs()), BuildImage(TorchLikeSpecs()));
}

TEST(ArchiveLayoutTest, RejectsInvalidPlans) {
  EXPECT_EQ(ArchiveLayout::Plan({}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ArchiveLayout::Plan({{"", 1}}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ArchiveLayout::Plan({{"a", 1}, {"b", 1}, {"a", 2}}).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(ArchiveLayout::Plan({{std::string(kMaxRecordNameLength + 1, 'a'), 1}}).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(ArchiveLayout::Plan({{"a", UINT64_MAX - 10}}).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(ArchiveLayout::Plan({{"a", UINT64_MAX / 2}, {"b", UINT64_MAX / 2}}).status().code(),
            StatusCode::kInvalidArgument);
  std::vector<RecordSpec> too_many(kMaxRecords + 1);
  for (size_t i = 0; i < too_many.size(); ++i) too_many[i].name = std::to_string(i);
  EXPECT_EQ(ArchiveLayout::Plan(too_many).status().code(), StatusCode::kInvalidArgument);
  auto layout = ArchiveLayout::Plan({{"a", 1}});
  ASSERT_TRUE(layout.ok());
  EXPECT_FALSE(layout->Tail({}).ok());
}

// --- zip64: sizes and offsets past 4 GiB, without materializing the payloads ---

// An image of headers and tail only; every other byte reads as zero.
struct SparseImage {
  std::map<uint64_t, std::string> segments;
  uint64_t size = 0;
  ReadAtFn Reader() const {
    return [this](uint64_t offset, size_t n, void* dst) -> Result<size_t> {
      if (offset >= size) return size_t{0};
      n = std::min<uint64_t>(n, size - offset);
      auto* out = static_cast<char*>(dst);
      std::memset(out, 0, n);
      // Segments do not overlap: start from the last one beginning at or before offset.
      auto it = segments.upper_bound(offset);
      if (it != segments.begin()) --it;
      for (int visited = 0; it != segments.end() && visited < 3; ++it, ++visited) {
        const auto& [start, bytes] = *it;
        if (start >= offset + n) break;
        const uint64_t end = start + bytes.size();
        const uint64_t lo = std::max(start, offset), hi = std::min(end, offset + n);
        if (lo < hi) std::memcpy(out + (lo - offset), bytes.data() + (lo - start), hi - lo);
      }
      return n;
    };
  }
};

SparseImage BuildSparse(const ArchiveLayout& layout) {
  SparseImage img;
  std::vector<uint32_t> crcs;
  for (size_t i = 0; i < layout.records().size(); ++i) {
    const uint32_t crc = 0x1000 + static_cast<uint32_t>(i);
    crcs.push_back(crc);
    img.segments[layout.records()[i].header_offset] = layout.LocalHeader(i, crc);
  }
  auto tail = layout.Tail(crcs);
  EXPECT_TRUE(tail.ok());
  img.segments[layout.tail_offset()] = *tail;
  img.size = layout.file_size();
  return img;
}

void ExpectSparseRoundTrip(const std::vector<RecordSpec>& specs) {
  auto layout = ArchiveLayout::Plan(specs);
  ASSERT_TRUE(layout.ok()) << layout.status().ToString();
  SparseImage img = BuildSparse(*layout);
  auto index = ArchiveIndex::Parse(img.size, img.Reader());
  ASSERT_TRUE(index.ok()) << index.status().ToString();
  ASSERT_EQ(index->records().size(), specs.size());
  for (size_t i = 0; i < specs.size(); ++i) {
    EXPECT_EQ(index->records()[i].name, specs[i].name);
    EXPECT_EQ(index->records()[i].size, specs[i].size);
    EXPECT_EQ(index->records()[i].data_offset, layout->records()[i].data_offset);
    EXPECT_EQ(index->records()[i].crc32, 0x1000u + i);
  }
}

TEST(ArchiveZip64Test, LargeRecordsAndOffsets) {
  const uint64_t GiB = 1ull << 30;
  ExpectSparseRoundTrip({{"data.pkl", 100},
                         {"data/0", 5 * GiB + 3},    // size needs zip64
                         {"data/1", 10},             // offset needs zip64
                         {"data/2", 0xFFFFFFFFull},  // exactly the sentinel
                         {"data/3", 0xFFFFFFFEull},
                         {"version", 2}});
  ExpectSparseRoundTrip({{"a", 0xFFFFFFFFull - 4096}, {"b", 1}});  // offset just around 4 GiB
  ExpectSparseRoundTrip({{"big", 6 * GiB}});
}

TEST(ArchiveZip64Test, ManyEntries) {
  // >= 0xFFFF entries forces the zip64 end records even for a small file.
  std::vector<RecordSpec> specs;
  for (int i = 0; i < 0xFFFF + 2; ++i) specs.push_back({std::to_string(i), 0});
  ExpectSparseRoundTrip(specs);
  specs.resize(0xFFFF - 1);
  ExpectSparseRoundTrip(specs);
}

TEST(ArchiveZip64Test, LocalHeaderCarriesZip64Sizes) {
  auto layout = ArchiveLayout::Plan({{"big", 5ull << 30}});
  ASSERT_TRUE(layout.ok());
  const std::string h = layout->LocalHeader(0, 7);
  const auto* p = reinterpret_cast<const unsigned char*>(h.data());
  EXPECT_EQ(zip::Get16(p + 4), 45);
  EXPECT_EQ(zip::Get32(p + 18), 0xFFFFFFFFu);
  EXPECT_EQ(zip::Get32(p + 22), 0xFFFFFFFFu);
  const size_t extra = 30 + zip::Get16(p + 26);
  EXPECT_EQ(zip::Get16(p + extra), zip::kZip64ExtraId);
  EXPECT_EQ(zip::Get16(p + extra + 2), 16);
  EXPECT_EQ(zip::Get64(p + extra + 4), 5ull << 30);
  EXPECT_EQ(zip::Get16(p + extra + 20), zip::kPaddingExtraId);
}

// --- a plain torch.save-style archive (no padding, 64-byte alignment not required) ---

std::string MinimalZip(const std::vector<std::pair<std::string, std::string>>& files,
                       size_t align = 1) {
  using namespace zip;  // NOLINT
  std::string image, cd;
  for (const auto& [name, data] : files) {
    const uint64_t offset = image.size();
    const uint32_t crc = Crc32(0, data.data(), data.size());
    const size_t unpadded = offset + 30 + name.size();
    const size_t pad = align > 1 ? (align - unpadded % align) % align : 0;
    const size_t extra = pad == 0 ? 0 : (pad < 4 ? pad + align : pad);
    Put32(&image, kLocalHeaderSig);
    for (uint16_t v : {20, 0, 0, 0, 0x21}) Put16(&image, v);
    Put32(&image, crc);
    Put32(&image, uint32_t(data.size()));
    Put32(&image, uint32_t(data.size()));
    Put16(&image, uint16_t(name.size()));
    Put16(&image, uint16_t(extra));
    image += name;
    if (extra) {
      Put16(&image, 0x4246);  // "FB", as torch does
      Put16(&image, uint16_t(extra - 4));
      image.append(extra - 4, 'Z');
    }
    image += data;
    Put32(&cd, kCentralHeaderSig);
    for (uint16_t v : {20, 20, 0, 0, 0, 0x21}) Put16(&cd, v);
    Put32(&cd, crc);
    Put32(&cd, uint32_t(data.size()));
    Put32(&cd, uint32_t(data.size()));
    for (uint16_t v : {uint16_t(name.size()), uint16_t(0), uint16_t(0), uint16_t(0), uint16_t(0)})
      Put16(&cd, v);
    Put32(&cd, 0);
    Put32(&cd, uint32_t(offset));
    cd += name;
  }
  const uint32_t cd_offset = uint32_t(image.size());
  image += cd;
  Put32(&image, kEndOfCentralDirSig);
  for (uint16_t v : {uint16_t(0), uint16_t(0), uint16_t(files.size()), uint16_t(files.size())})
    Put16(&image, v);
  Put32(&image, uint32_t(cd.size()));
  Put32(&image, cd_offset);
  Put16(&image, 0);
  return image;
}

TEST(ArchiveIndexTest, ParsesUnalignedTorchStyleArchives) {
  for (size_t align : {size_t{1}, size_t{64}}) {
    const std::string image = MinimalZip({{"model/data.pkl", "pickle"},
                                          {"model/data/0", std::string(100, 'x')},
                                          {"model/version", "3\n"}},
                                         align);
    auto index = ParseImage(image);
    ASSERT_TRUE(index.ok()) << index.status().ToString();
    EXPECT_EQ(index->prefix(), "model");
    const RecordEntry* d0 = index->Find("data/0");
    ASSERT_NE(d0, nullptr);
    EXPECT_EQ(image.substr(d0->data_offset, d0->size), std::string(100, 'x'));
    if (align == 64) {
      EXPECT_EQ(d0->data_offset % 64, 0u);
    }
  }
}

TEST(ArchiveIndexTest, ToleratesComment) {
  std::string image = MinimalZip({{"a/b", "xyz"}});
  image[image.size() - 2] = 5;
  image += "hello";
  EXPECT_TRUE(ParseImage(image).ok());
}

// --- malformed input ---

void ExpectCorrupt(const std::string& image, const std::string& fragment) {
  auto index = ParseImage(image);
  ASSERT_FALSE(index.ok());
  EXPECT_EQ(index.status().code(), StatusCode::kCorruption) << index.status().ToString();
  EXPECT_NE(index.status().message().find(fragment), std::string::npos)
      << "message: " << index.status().message() << "; expected: " << fragment;
}

// Offset of central entry i in an image made by BuildImage.
size_t CentralEntryOffset(const std::string& image, const ArchiveLayout& layout, size_t i) {
  size_t p = layout.tail_offset();
  const auto* u = reinterpret_cast<const unsigned char*>(image.data());
  for (size_t k = 0; k < i; ++k) {
    p += 46 + zip::Get16(u + p + 28) + zip::Get16(u + p + 30) + zip::Get16(u + p + 32);
  }
  return p;
}

void Poke16(std::string* s, size_t at, uint16_t v) {
  std::string b;
  zip::Put16(&b, v);
  s->replace(at, 2, b);
}
void Poke32(std::string* s, size_t at, uint32_t v) {
  std::string b;
  zip::Put32(&b, v);
  s->replace(at, 4, b);
}

TEST(ArchiveIndexTest, RejectsEmptyAndTinyFiles) {
  ExpectCorrupt("", "too small");
  ExpectCorrupt(std::string(21, '\0'), "too small");
  ExpectCorrupt(std::string(100, '\0'), "not found");
  ExpectCorrupt(MinimalZip({}), "no records");
}

TEST(ArchiveIndexTest, RejectsTruncation) {
  const std::string image = BuildImage(TorchLikeSpecs());
  for (size_t cut = 0; cut < image.size();
       cut += (cut < 200 || image.size() - cut < 5000) ? 1 : 97) {
    const std::string t = image.substr(0, cut);
    auto index = ParseImage(t);
    EXPECT_FALSE(index.ok()) << "cut " << cut;
  }
  // A reader that returns fewer bytes than the file size promised.
  auto index = ArchiveIndex::Parse(image.size() + 10, StringReader(&image));
  EXPECT_FALSE(index.ok());
}

TEST(ArchiveIndexTest, BitFlipsNeverCrash) {
  ArchiveLayout layout;
  const std::string image =
      BuildImage({{"data.pkl", 10}, {"data/0", 5}, {"data/1", 0}, {"version", 2}}, &layout);
  // Header regions: the 30 + name + first extra bytes of each local header, and the tail.
  std::vector<std::pair<size_t, size_t>> regions;
  for (const RecordPlacement& r : layout.records()) {
    regions.push_back({r.header_offset, r.header_offset + 30 + 8 + r.name.size() + 4});
  }
  regions.push_back({layout.tail_offset(), image.size()});
  size_t failures = 0, total = 0;
  for (const auto& [begin, end] : regions) {
    for (size_t at = begin; at < end; ++at) {
      for (int bit = 0; bit < 8; ++bit) {
        std::string m = image;
        m[at] = static_cast<char>(m[at] ^ (1 << bit));
        auto index = ParseImage(m);
        ++total;
        if (!index.ok()) {
          ++failures;
          EXPECT_EQ(index.status().code(), StatusCode::kCorruption) << index.status().ToString();
        }
      }
    }
  }
  EXPECT_GT(failures, total / 4);  // most flips in structure are caught
}

TEST(ArchiveIndexTest, RejectsOverlappingRecords) {
  ArchiveLayout layout;
  std::string image = BuildImage({{"a", 10}, {"b", 10}}, &layout);
  const size_t e0 = CentralEntryOffset(image, layout, 0);
  Poke32(&image, e0 + 20, 4096 + 10);  // record a grows over b's local header
  Poke32(&image, e0 + 24, 4096 + 10);
  ExpectCorrupt(image, "overlap");
}

TEST(ArchiveIndexTest, RejectsTwoEntriesForOneRecord) {
  ArchiveLayout layout;
  std::string image = BuildImage({{"a", 10}, {"b", 10}}, &layout);
  // Entry b points at a's local header: names differ.
  const size_t e1 = CentralEntryOffset(image, layout, 1);
  Poke32(&image, e1 + 42, 0);
  ExpectCorrupt(image, "local header names");
}

TEST(ArchiveIndexTest, RejectsOutOfRangeOffsets) {
  ArchiveLayout layout;
  const std::string good = BuildImage({{"a", 10}, {"b", 10}}, &layout);
  const size_t e1 = CentralEntryOffset(good, layout, 1);
  std::string image = good;
  Poke32(&image, e1 + 42, 0xFFFFFFF0u);
  ExpectCorrupt(image, "not before the central directory");
  image = good;
  Poke32(&image, e1 + 20, 0x7FFFFFFF);  // size past the directory
  Poke32(&image, e1 + 24, 0x7FFFFFFF);
  ExpectCorrupt(image, "extends past");
  image = good;
  Poke32(&image, image.size() - 6, 0x7FFFFFFF);  // central directory offset
  ExpectCorrupt(image, "outside the file");
  image = good;
  Poke32(&image, image.size() - 10, 0x7FFFFFFF);  // central directory size
  ExpectCorrupt(image, "exceeds the limit");
  image = good;
  Poke32(&image, image.size() - 10, 1000);  // central directory size
  ExpectCorrupt(image, "outside the file");
}

TEST(ArchiveIndexTest, RejectsHugeCounts) {
  ArchiveLayout layout;
  const std::string good = BuildImage({{"a", 10}, {"b", 10}}, &layout);
  std::string image = good;
  Poke16(&image, image.size() - 14, 0xFFFF);
  Poke16(&image, image.size() - 12, 0xFFFF);
  ExpectCorrupt(image, "cannot hold");
  image = good;
  Poke16(&image, image.size() - 14, 1);  // entries on this disk != total
  ExpectCorrupt(image, "multi-disk");
  image = good;
  Poke16(&image, image.size() - 14, 3);
  Poke16(&image, image.size() - 12, 3);
  ExpectCorrupt(image, "cannot hold");
  image = good;
  Poke16(&image, image.size() - 14, 1);
  Poke16(&image, image.size() - 12, 1);
  ExpectCorrupt(image, "trailing bytes");

  // zip64 end record claiming 2^40 entries.
  std::vector<RecordSpec> specs;
  for (int i = 0; i < 0xFFFF; ++i) specs.push_back({std::to_string(i), 0});
  auto big = ArchiveLayout::Plan(specs);
  ASSERT_TRUE(big.ok());
  SparseImage sparse = BuildSparse(*big);
  std::string& tail = sparse.segments[big->tail_offset()];
  const size_t z = tail.size() - 22 - 20 - 56;
  ASSERT_EQ(zip::Get32(reinterpret_cast<const unsigned char*>(tail.data()) + z),
            zip::kZip64EndOfCentralDirSig);
  std::string b;
  zip::Put64(&b, 1ull << 40);
  tail.replace(z + 24, 8, b);
  tail.replace(z + 32, 8, b);
  auto index = ArchiveIndex::Parse(sparse.size, sparse.Reader());
  ASSERT_FALSE(index.ok());
  EXPECT_NE(index.status().message().find("more than the limit"), std::string::npos)
      << index.status().ToString();
}

TEST(ArchiveIndexTest, RejectsCompressionAndEncryption) {
  ArchiveLayout layout;
  const std::string good = BuildImage({{"a", 10}, {"b", 10}}, &layout);
  const size_t e1 = CentralEntryOffset(good, layout, 1);
  std::string image = good;
  Poke16(&image, e1 + 10, 8);  // deflate
  ExpectCorrupt(image, "compression method 8");
  image = good;
  Poke16(&image, e1 + 8, 1);  // encrypted
  ExpectCorrupt(image, "encrypted");
  image = good;
  Poke32(&image, e1 + 20, 9);  // compressed != uncompressed
  ExpectCorrupt(image, "compressed size 9 != uncompressed size 10");
  image = good;
  Poke16(&image, layout.records()[1].header_offset + 8, 8);  // local header says deflate
  ExpectCorrupt(image, "not stored");
}

TEST(ArchiveIndexTest, RejectsBadNames) {
  ExpectCorrupt(MinimalZip({{"a/x", "1"}, {"a/x", "2"}}), "duplicate record name 'x'");
  ExpectCorrupt(MinimalZip({{"a/x", "1"}, {"b/y", "2"}}), "prefix");
  ExpectCorrupt(MinimalZip({{"noslash", "1"}}), "is not '<prefix>/<name>'");
  ExpectCorrupt(MinimalZip({{"/x", "1"}}), "is not '<prefix>/<name>'");
  ExpectCorrupt(MinimalZip({{"a/", "1"}}), "is not '<prefix>/<name>'");
  ExpectCorrupt(MinimalZip({{std::string("a/x\0y", 5), "1"}}), "NUL");
  ExpectCorrupt(MinimalZip({{"a/" + std::string(kMaxRecordNameLength + 1, 'n'), "1"}}),
                "longer than");

  // Duplicate made from a valid nebulite archive: rename "b" to "a" everywhere.
  ArchiveLayout layout;
  std::string image = BuildImage({{"a", 10}, {"b", 10}}, &layout);
  image[layout.records()[1].header_offset + 30 + 8] = 'a';
  image[CentralEntryOffset(image, layout, 1) + 46 + 8] = 'a';
  ExpectCorrupt(image, "duplicate record name 'a'");
}

TEST(ArchiveIndexTest, RejectsMissingZip64Extra) {
  ArchiveLayout layout;
  std::string image = BuildImage({{"a", 10}}, &layout);
  const size_t e0 = CentralEntryOffset(image, layout, 0);
  Poke32(&image, e0 + 42, 0xFFFFFFFF);
  ExpectCorrupt(image, "zip64 extra field missing");
}

TEST(ArchiveIndexTest, PropagatesReadErrors) {
  const std::string image = BuildImage({{"a", 10}});
  auto index = ArchiveIndex::Parse(image.size(), [](uint64_t, size_t, void*) -> Result<size_t> {
    return Status::IOError("disk on fire");
  });
  ASSERT_FALSE(index.ok());
  EXPECT_EQ(index.status().code(), StatusCode::kIOError);
}

}  // namespace
}  // namespace nebulite::format
