// Text encodings of manifests, commit records and the writer lease (docs/format.md, "Persistent
// layout, manifests and commit markers", is normative).
//
// Both are line based, every line ends in "\n", fields are separated by one space and
// the last line is "end <crc32>" over all preceding bytes. Strings are percent-encoded
// so that they never contain a space or a newline. The decoders treat their input as
// hostile: bounded size, strict syntax (one canonical spelling per value), checked
// numbers, and the CRC, so a truncation or a flipped bit is always rejected.
#include <cstdint>
#include <cstdio>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "nebulite/commit.h"
#include "nebulite/crc32.h"
#include "nebulite/lease.h"

namespace nebulite {
namespace {

constexpr std::string_view kManifestMagic = "nebulite-manifest";
constexpr std::string_view kCommitMagic = "nebulite-commit";
constexpr std::string_view kLeaseMagic = "nebulite-lease";

std::string Hex8(uint32_t v) {
  char buf[9];
  std::snprintf(buf, sizeof(buf), "%08x", v);
  return buf;
}

// Escapes every byte outside printable ASCII 0x21..0x7E, and '%', as "%XX" (uppercase).
std::string Escape(std::string_view s) {
  static constexpr char kHex[] = "0123456789ABCDEF";
  std::string out;
  out.reserve(s.size());
  for (unsigned char c : s) {
    if (c < 0x21 || c > 0x7E || c == '%') {
      out += '%';
      out += kHex[c >> 4];
      out += kHex[c & 0xF];
    } else {
      out += static_cast<char>(c);
    }
  }
  return out;
}

int HexDigit(char c, bool allow_upper, bool allow_lower) {
  if (c >= '0' && c <= '9') return c - '0';
  if (allow_upper && c >= 'A' && c <= 'F') return c - 'A' + 10;
  if (allow_lower && c >= 'a' && c <= 'f') return c - 'a' + 10;
  return -1;
}

uint32_t Crc(std::string_view s) { return Crc32(0, s.data(), s.size()); }

// Parses the body of a record line by line. Every failure is Corruption, with the
// record kind and the line number in the message.
class LineParser {
 public:
  LineParser(std::string_view body, const char* kind) : rest_(body), kind_(kind) {}

  bool AtEnd() const { return rest_.empty(); }

  Status Error(const std::string& what) const {
    return Status::Corruption(std::string(kind_) + " line " + std::to_string(line_no_) + ": " +
                              what);
  }

  // Takes the next line (without "\n"); false if none is left.
  bool NextLine(std::string_view* line) {
    if (rest_.empty()) return false;
    size_t nl = rest_.find('\n');
    if (nl == std::string_view::npos) return false;  // cannot happen: body ends in "\n"
    *line = rest_.substr(0, nl);
    rest_.remove_prefix(nl + 1);
    ++line_no_;
    return true;
  }

  // Reads "key <fields...>" and splits the fields on single spaces.
  Status ReadFields(std::string_view key, size_t count, std::vector<std::string_view>* fields) {
    std::string_view line;
    if (!NextLine(&line)) {
      ++line_no_;
      return Error("missing '" + std::string(key) + "' line");
    }
    fields->clear();
    size_t start = 0;
    while (true) {
      size_t sp = line.find(' ', start);
      fields->push_back(line.substr(start, sp == std::string_view::npos ? sp : sp - start));
      if (sp == std::string_view::npos) break;
      start = sp + 1;
    }
    if (fields->size() != count + 1 || (*fields)[0] != key) {
      return Error("expected '" + std::string(key) + "' with " + std::to_string(count) +
                   " field(s)");
    }
    fields->erase(fields->begin());
    return Status::OK();
  }

  Status ParseU64(std::string_view s, uint64_t max, uint64_t* out) const {
    if (s.empty() || s.size() > 20) return Error("bad number");
    if (s.size() > 1 && s[0] == '0') return Error("number with leading zero");
    uint64_t v = 0;
    for (char c : s) {
      if (c < '0' || c > '9') return Error("bad number");
      uint64_t d = static_cast<uint64_t>(c - '0');
      if (v > (UINT64_MAX - d) / 10) return Error("number out of range");
      v = v * 10 + d;
    }
    if (v > max) return Error("number out of range");
    *out = v;
    return Status::OK();
  }

  Status ParseU32(std::string_view s, uint32_t* out) const {
    uint64_t v;
    NEBULITE_RETURN_IF_ERROR(ParseU64(s, UINT32_MAX, &v));
    *out = static_cast<uint32_t>(v);
    return Status::OK();
  }

  Status ParseI64(std::string_view s, int64_t* out) const {
    bool negative = !s.empty() && s[0] == '-';
    if (negative) s.remove_prefix(1);
    uint64_t v;
    NEBULITE_RETURN_IF_ERROR(
        ParseU64(s, negative ? uint64_t{1} << 63 : (uint64_t{1} << 63) - 1, &v));
    if (negative && v == 0) return Error("negative zero");
    *out = negative ? static_cast<int64_t>(0 - v) : static_cast<int64_t>(v);
    return Status::OK();
  }

  Status ParseHex8(std::string_view s, uint32_t* out) const {
    if (s.size() != 8) return Error("checksum must be 8 lowercase hex digits");
    uint32_t v = 0;
    for (char c : s) {
      int d = HexDigit(c, false, true);
      if (d < 0) return Error("checksum must be 8 lowercase hex digits");
      v = (v << 4) | static_cast<uint32_t>(d);
    }
    *out = v;
    return Status::OK();
  }

  // Decodes a percent-encoded path component; only the canonical encoding is accepted.
  Status ParseName(std::string_view s, const char* what, std::string* out) const {
    out->clear();
    for (size_t i = 0; i < s.size(); ++i) {
      unsigned char c = static_cast<unsigned char>(s[i]);
      if (c != '%') {
        if (c < 0x21 || c > 0x7E) return Error(std::string("unescaped byte in ") + what);
        *out += static_cast<char>(c);
        continue;
      }
      if (i + 2 >= s.size()) {
        return Error(std::string("truncated escape in ") + what);
      }
      int hi = HexDigit(s[i + 1], true, false);
      int lo = HexDigit(s[i + 2], true, false);
      if (hi < 0 || lo < 0) return Error(std::string("bad escape in ") + what);
      unsigned char decoded = static_cast<unsigned char>(hi * 16 + lo);
      if (decoded >= 0x21 && decoded <= 0x7E && decoded != '%') {
        return Error(std::string("needless escape in ") + what);
      }
      *out += static_cast<char>(decoded);
      i += 2;
    }
    Status valid = ValidatePathComponent(*out, what);
    if (!valid.ok()) return Error(valid.message());
    return Status::OK();
  }

 private:
  std::string_view rest_;
  const char* kind_;
  int line_no_ = 0;
};

// Checks the header line and the trailing "end <crc>" line; returns the lines between.
// A header with a higher version is UnsupportedVersion: a newer layout may differ
// after its first line, so the version is checked before anything else.
Result<std::string_view> CheckFrame(std::string_view text, std::string_view magic,
                                    const char* kind) {
  const std::string k(kind);
  if (text.size() > kMaxManifestBytes) {
    return Status::Corruption(k + " is larger than " + std::to_string(kMaxManifestBytes) +
                              " bytes");
  }
  size_t nl = text.find('\n');
  if (nl == std::string_view::npos) return Status::Corruption(k + ": no header line");
  std::string_view header = text.substr(0, nl);
  if (header.size() <= magic.size() + 1 || header.substr(0, magic.size()) != magic ||
      header[magic.size()] != ' ') {
    return Status::Corruption(k + ": not a " + k + " (bad header line)");
  }
  LineParser p(header, kind);
  uint64_t version = 0;
  if (!p.ParseU64(header.substr(magic.size() + 1), UINT64_MAX, &version).ok() || version == 0) {
    return Status::Corruption(k + ": bad format version in header line");
  }
  if (version > kManifestVersion) {
    return Status::UnsupportedVersion(k + " format version " + std::to_string(version) +
                                      " is newer than this build supports (" +
                                      std::to_string(kManifestVersion) + ")");
  }
  // The last line: "end " + 8 hex + "\n".
  constexpr size_t kEndLineSize = 4 + 8 + 1;
  if (text.size() < nl + 1 + kEndLineSize || text.back() != '\n') {
    return Status::Corruption(k + ": truncated (no end line)");
  }
  std::string_view end_line = text.substr(text.size() - kEndLineSize);
  std::string_view covered = text.substr(0, text.size() - kEndLineSize);
  if (end_line.substr(0, 4) != "end " || covered.back() != '\n') {
    return Status::Corruption(k + ": truncated (no end line)");
  }
  uint32_t stored = 0;
  NEBULITE_RETURN_IF_ERROR(p.ParseHex8(end_line.substr(4, 8), &stored));
  uint32_t actual = Crc(covered);
  if (stored != actual) {
    return Status::Corruption(k + ": checksum mismatch (stored " + Hex8(stored) + ", computed " +
                              Hex8(actual) + ")");
  }
  return covered.substr(nl + 1);
}

void AppendEnd(std::string* out) { *out += "end " + Hex8(Crc(*out)) + "\n"; }

}  // namespace

std::string EncodeManifest(const Manifest& m) {
  std::string out;
  out += std::string(kManifestMagic) + " " + std::to_string(kManifestVersion) + "\n";
  out += "tag " + Escape(m.tag) + "\n";
  out += "version " + Escape(m.version) + "\n";
  out += "rank " + std::to_string(m.rank) + "\n";
  out += "world_size " + std::to_string(m.world_size) + "\n";
  for (const ManifestFile& f : m.files) {
    out += "file " + std::to_string(f.size) + " " + Hex8(f.crc32) + " " + Escape(f.name) + "\n";
  }
  AppendEnd(&out);
  return out;
}

Result<Manifest> DecodeManifest(const std::string& text) {
  NEBULITE_ASSIGN_OR_RETURN(std::string_view body, CheckFrame(text, kManifestMagic, "manifest"));
  LineParser p(body, "manifest");
  std::vector<std::string_view> f;
  Manifest m;
  NEBULITE_RETURN_IF_ERROR(p.ReadFields("tag", 1, &f));
  NEBULITE_RETURN_IF_ERROR(p.ParseName(f[0], "tag", &m.tag));
  NEBULITE_RETURN_IF_ERROR(p.ReadFields("version", 1, &f));
  NEBULITE_RETURN_IF_ERROR(p.ParseName(f[0], "version", &m.version));
  NEBULITE_RETURN_IF_ERROR(p.ReadFields("rank", 1, &f));
  NEBULITE_RETURN_IF_ERROR(p.ParseU32(f[0], &m.rank));
  NEBULITE_RETURN_IF_ERROR(p.ReadFields("world_size", 1, &f));
  NEBULITE_RETURN_IF_ERROR(p.ParseU32(f[0], &m.world_size));
  if (m.world_size == 0) return p.Error("world_size must be at least 1");
  if (m.rank >= m.world_size) return p.Error("rank must be below world_size");
  std::set<std::string> names;
  while (!p.AtEnd()) {
    NEBULITE_RETURN_IF_ERROR(p.ReadFields("file", 3, &f));
    ManifestFile file;
    NEBULITE_RETURN_IF_ERROR(p.ParseU64(f[0], UINT64_MAX, &file.size));
    NEBULITE_RETURN_IF_ERROR(p.ParseHex8(f[1], &file.crc32));
    NEBULITE_RETURN_IF_ERROR(p.ParseName(f[2], "file name", &file.name));
    if (!names.insert(file.name).second) return p.Error("duplicate file name");
    m.files.push_back(std::move(file));
  }
  return m;
}

std::string EncodeCommitRecord(const CommitRecord& c) {
  std::string out;
  out += std::string(kCommitMagic) + " " + std::to_string(kManifestVersion) + "\n";
  out += "tag " + Escape(c.tag) + "\n";
  out += "version " + Escape(c.version) + "\n";
  out += "seq " + std::to_string(c.seq) + "\n";
  out += "time_unix_ns " + std::to_string(c.time_unix_ns) + "\n";
  out += "world_size " + std::to_string(c.world_size) + "\n";
  for (size_t r = 0; r < c.manifest_crc32.size(); ++r) {
    out += "manifest " + std::to_string(r) + " " + Hex8(c.manifest_crc32[r]) + "\n";
  }
  AppendEnd(&out);
  return out;
}

Result<CommitRecord> DecodeCommitRecord(const std::string& text) {
  NEBULITE_ASSIGN_OR_RETURN(std::string_view body, CheckFrame(text, kCommitMagic, "commit record"));
  LineParser p(body, "commit record");
  std::vector<std::string_view> f;
  CommitRecord c;
  NEBULITE_RETURN_IF_ERROR(p.ReadFields("tag", 1, &f));
  NEBULITE_RETURN_IF_ERROR(p.ParseName(f[0], "tag", &c.tag));
  NEBULITE_RETURN_IF_ERROR(p.ReadFields("version", 1, &f));
  NEBULITE_RETURN_IF_ERROR(p.ParseName(f[0], "version", &c.version));
  NEBULITE_RETURN_IF_ERROR(p.ReadFields("seq", 1, &f));
  NEBULITE_RETURN_IF_ERROR(p.ParseU64(f[0], UINT64_MAX, &c.seq));
  NEBULITE_RETURN_IF_ERROR(p.ReadFields("time_unix_ns", 1, &f));
  NEBULITE_RETURN_IF_ERROR(p.ParseI64(f[0], &c.time_unix_ns));
  NEBULITE_RETURN_IF_ERROR(p.ReadFields("world_size", 1, &f));
  NEBULITE_RETURN_IF_ERROR(p.ParseU32(f[0], &c.world_size));
  if (c.world_size == 0) return p.Error("world_size must be at least 1");
  // Exactly world_size manifest lines, ranks in order; the size bound on the text bounds
  // the loop, so world_size is never used to allocate up front.
  for (uint64_t r = 0; r < c.world_size; ++r) {
    NEBULITE_RETURN_IF_ERROR(p.ReadFields("manifest", 2, &f));
    uint64_t rank;
    NEBULITE_RETURN_IF_ERROR(p.ParseU64(f[0], UINT32_MAX, &rank));
    if (rank != r) return p.Error("manifest lines must list ranks 0..world_size-1 in order");
    uint32_t crc;
    NEBULITE_RETURN_IF_ERROR(p.ParseHex8(f[1], &crc));
    c.manifest_crc32.push_back(crc);
  }
  if (!p.AtEnd()) return p.Error("unexpected line after the manifest lines");
  return c;
}

std::string EncodeLease(const Lease& lease) {
  std::string out;
  out += std::string(kLeaseMagic) + " " + std::to_string(kManifestVersion) + "\n";
  out += "run " + Escape(lease.run) + "\n";
  out += "host " + Escape(lease.host) + "\n";
  out += "pid " + std::to_string(lease.pid) + "\n";
  out += "renewed_unix_ns " + std::to_string(lease.renewed_unix_ns) + "\n";
  out += "ttl_seconds " + std::to_string(lease.ttl_seconds) + "\n";
  AppendEnd(&out);
  return out;
}

Result<Lease> DecodeLease(const std::string& text) {
  NEBULITE_ASSIGN_OR_RETURN(std::string_view body, CheckFrame(text, kLeaseMagic, "lease"));
  LineParser p(body, "lease");
  std::vector<std::string_view> f;
  Lease lease;
  NEBULITE_RETURN_IF_ERROR(p.ReadFields("run", 1, &f));
  NEBULITE_RETURN_IF_ERROR(p.ParseName(f[0], "run", &lease.run));
  NEBULITE_RETURN_IF_ERROR(p.ReadFields("host", 1, &f));
  NEBULITE_RETURN_IF_ERROR(p.ParseName(f[0], "host", &lease.host));
  NEBULITE_RETURN_IF_ERROR(p.ReadFields("pid", 1, &f));
  NEBULITE_RETURN_IF_ERROR(p.ParseU32(f[0], &lease.pid));
  NEBULITE_RETURN_IF_ERROR(p.ReadFields("renewed_unix_ns", 1, &f));
  NEBULITE_RETURN_IF_ERROR(p.ParseI64(f[0], &lease.renewed_unix_ns));
  NEBULITE_RETURN_IF_ERROR(p.ReadFields("ttl_seconds", 1, &f));
  NEBULITE_RETURN_IF_ERROR(p.ParseU32(f[0], &lease.ttl_seconds));
  if (!p.AtEnd()) return p.Error("unexpected line after 'ttl_seconds'");
  return lease;
}

}  // namespace nebulite
