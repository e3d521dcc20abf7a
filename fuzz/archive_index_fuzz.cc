// libFuzzer target for ArchiveIndex::Parse, the loader's attack surface: whatever
// parses must satisfy the invariants Parse promises (records inside the file, found by
// name).
//
// Built by CMake with -DNEBULITE_BUILD_FUZZERS=ON and run by `make fuzz` (see
// fuzz/README.md); the seed corpus is fuzz/corpus/archive_index_fuzz.
//
// Without clang, -DNEBULITE_FUZZ_STANDALONE builds a main() (g++ works) that runs the
// target once on each file named on the command line, e.g. to replay a crash.
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "nebulite/format.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using nebulite::Result;
  auto read_at = [data, size](uint64_t offset, size_t n, void* dst) -> Result<size_t> {
    if (offset >= size) return size_t{0};
    const size_t k = n < size - offset ? n : static_cast<size_t>(size - offset);
    std::memcpy(dst, data + offset, k);
    return k;
  };
  auto index = nebulite::format::ArchiveIndex::Parse(size, read_at);
  if (index.ok()) {
    // Whatever parses must satisfy the invariants Parse promises.
    for (const auto& r : index->records()) {
      if (r.data_offset > size || r.size > size - r.data_offset) __builtin_trap();
      if (index->Find(r.name) == nullptr) __builtin_trap();
    }
  }
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
