// libFuzzer target for the text records of the commit protocol: DecodeManifest and
// DecodeCommitRecord (docs/format.md, "Text encoding rules").
//
// Every input goes through both decoders (the magic on the first line selects at most
// one) twice: as it is, and with its "end <crc>" line made right (replaced, or appended),
// so that mutations reach the syntax behind the checksum instead of stopping at it.
// The encoding is canonical, so whatever decodes must re-encode to exactly the bytes
// decoded; and a decoder may only fail with Corruption or UnsupportedVersion.
//
// Built by CMake with -DNEBULITE_BUILD_FUZZERS=ON (see fuzz/README.md); without clang,
// -DNEBULITE_FUZZ_STANDALONE builds a main() that runs the target once on each file
// named on the command line, e.g. to replay a crash.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "nebulite/commit.h"
#include "nebulite/crc32.h"

namespace {

[[noreturn]] void Fail(const char* what, const std::string& input, const std::string& output) {
  std::fprintf(stderr, "%s\n--- input (%zu bytes) ---\n%s\n--- re-encoded (%zu bytes) ---\n%s\n",
               what, input.size(), input.c_str(), output.size(), output.c_str());
  std::abort();
}

// Decode failures are about the bytes, never anything else.
void CheckRejection(const nebulite::Status& st, const std::string& input) {
  using nebulite::StatusCode;
  if (st.code() != StatusCode::kCorruption && st.code() != StatusCode::kUnsupportedVersion)
    Fail(("unexpected status: " + st.ToString()).c_str(), input, "");
}

// The input with a correct last line: its own "end <crc>" line, if it has one, is
// replaced, else one is appended.
std::string WithValidEndLine(std::string text) {
  constexpr size_t kEndLineSize = 4 + 8 + 1;
  if (text.size() >= kEndLineSize && text.back() == '\n' &&
      text.compare(text.size() - kEndLineSize, 4, "end ") == 0)
    text.resize(text.size() - kEndLineSize);
  char end[kEndLineSize + 1];
  std::snprintf(end, sizeof(end), "end %08x\n", nebulite::Crc32(0, text.data(), text.size()));
  return text + end;
}

void CheckDecoders(const std::string& input) {
  auto manifest = nebulite::DecodeManifest(input);
  if (manifest.ok()) {
    const std::string again = nebulite::EncodeManifest(*manifest);
    if (again != input) Fail("a manifest does not re-encode to its own bytes", input, again);
  } else {
    CheckRejection(manifest.status(), input);
  }

  auto commit = nebulite::DecodeCommitRecord(input);
  if (commit.ok()) {
    if (manifest.ok()) Fail("both decoders accept the same bytes", input, "");
    if (commit->manifest_crc32.size() != commit->world_size)
      Fail("a commit record without one manifest line per rank", input, "");
    const std::string again = nebulite::EncodeCommitRecord(*commit);
    if (again != input) Fail("a commit record does not re-encode to its own bytes", input, again);
  } else {
    CheckRejection(commit.status(), input);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string input(reinterpret_cast<const char*>(data), size);
  CheckDecoders(input);
  CheckDecoders(WithValidEndLine(input));
  return 0;
}

#ifdef NEBULITE_FUZZ_STANDALONE
#include <fstream>
#include <iterator>
#include <vector>

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    std::ifstream f(argv[i], std::ios::binary);
    std::vector<char> bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
  }
  return 0;
}
#endif
