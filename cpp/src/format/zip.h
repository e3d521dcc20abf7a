// Internal: the zip (APPNOTE 6.3.x) record constants and little-endian helpers
// shared by ArchiveLayout (writer) and ArchiveIndex (reader). Not public API.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>

namespace nebulite::format::zip {

inline constexpr uint32_t kLocalHeaderSig = 0x04034b50;
inline constexpr uint32_t kCentralHeaderSig = 0x02014b50;
inline constexpr uint32_t kEndOfCentralDirSig = 0x06054b50;
inline constexpr uint32_t kZip64EndOfCentralDirSig = 0x06064b50;
inline constexpr uint32_t kZip64LocatorSig = 0x07064b50;

inline constexpr uint64_t kLocalHeaderSize = 30;
inline constexpr uint64_t kCentralHeaderSize = 46;
inline constexpr uint64_t kEndOfCentralDirSize = 22;
inline constexpr uint64_t kZip64EndOfCentralDirSize = 56;
inline constexpr uint64_t kZip64LocatorSize = 20;
inline constexpr uint64_t kMaxCommentSize = 0xFFFF;

inline constexpr uint16_t kZip64ExtraId = 0x0001;
// nebulite's padding extra field, "NB" (PyTorch pads with "FB" the same way).
inline constexpr uint16_t kPaddingExtraId = 0x4E42;
inline constexpr uint64_t kExtraHeaderSize = 4;  // id + length

inline constexpr uint16_t kVersionNeeded = 20;       // 2.0: stored files, directories
inline constexpr uint16_t kVersionNeededZip64 = 45;  // 4.5: zip64
inline constexpr uint16_t kDosTime = 0;              // 00:00:00
inline constexpr uint16_t kDosDate = 0x21;           // 1980-01-01

inline constexpr uint32_t kMax32 = 0xFFFFFFFF;
inline constexpr uint16_t kMax16 = 0xFFFF;

inline constexpr uint16_t kFlagEncrypted = 1u << 0;
inline constexpr uint16_t kFlagStrongEncryption = 1u << 6;

inline void Put16(std::string* s, uint16_t v) {
  s->push_back(static_cast<char>(v & 0xFF));
  s->push_back(static_cast<char>(v >> 8));
}
inline void Put32(std::string* s, uint32_t v) {
  for (int i = 0; i < 4; ++i) s->push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
}
inline void Put64(std::string* s, uint64_t v) {
  for (int i = 0; i < 8; ++i) s->push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
}

inline uint16_t Get16(const unsigned char* p) {
  return static_cast<uint16_t>(p[0] | (static_cast<uint16_t>(p[1]) << 8));
}
inline uint32_t Get32(const unsigned char* p) {
  return static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8) |
         (static_cast<uint32_t>(p[2]) << 16) | (static_cast<uint32_t>(p[3]) << 24);
}
inline uint64_t Get64(const unsigned char* p) {
  return static_cast<uint64_t>(Get32(p)) | (static_cast<uint64_t>(Get32(p + 4)) << 32);
}

}  // namespace nebulite::format::zip
