# The README's commands. Each installs what it needs first (scripts/setup.sh).
PY := .venv/bin/python
JOBS ?= 2
RELIABILITY_KILLS ?= 1000
FUZZ_SECONDS ?= 60
CMAKE := .venv/bin/cmake
NINJA := $(CURDIR)/.venv/bin/ninja
# Sanitized builds: optimised a little (the tests run much faster), assertions on.
SANITIZED := -G Ninja -DNEBULITE_BUILD_TESTS=ON -DCMAKE_BUILD_TYPE=Debug "-DCMAKE_CXX_FLAGS_DEBUG=-g -O1" \
  -DCMAKE_MAKE_PROGRAM=$(NINJA)

.PHONY: setup demo test test-cpp-build test-cpp test-py test-asan test-tsan fuzz fuzz-build bench bench-stores \
  reliability format clean

setup:
	bash scripts/setup.sh

demo: setup
	$(PY) examples/demo.py

# Every test, then every fuzz target for FUZZ_SECONDS seconds.
test: setup test-cpp test-py test-asan test-tsan fuzz

test-cpp-build:
	.venv/bin/cmake -S . -B build/tests -G Ninja -DNEBULITE_BUILD_TESTS=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo \
	  -DCMAKE_MAKE_PROGRAM=$(CURDIR)/.venv/bin/ninja >/dev/null
	.venv/bin/ninja -C build/tests -j $(JOBS) nebulite_tests

test-cpp: test-cpp-build
	./build/tests/nebulite_tests --gtest_brief=1

test-py:
	$(PY) -m pytest -q tests

# Every C++ test under AddressSanitizer and UndefinedBehaviorSanitizer.
test-asan:
	$(CMAKE) -S . -B build/asan $(SANITIZED) -DNEBULITE_SANITIZE=address >/dev/null
	$(NINJA) -C build/asan -j $(JOBS) nebulite_tests
	ASAN_OPTIONS=detect_leaks=1:check_initialization_order=1:strict_init_order=1 \
	  UBSAN_OPTIONS=print_stacktrace=1 ./build/asan/nebulite_tests --gtest_brief=1

# The tests of the code that runs on several threads under ThreadSanitizer.
test-tsan:
	$(CMAKE) -S . -B build/tsan $(SANITIZED) -DNEBULITE_SANITIZE=thread >/dev/null
	$(NINJA) -C build/tsan -j $(JOBS) nebulite_concurrency_tests
	TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1 \
	  ./build/tsan/nebulite_concurrency_tests --gtest_brief=1

# make fuzz FUZZ_SECONDS=3600 for a long run; findings are kept in build/fuzz/crashes/.
fuzz: setup fuzz-build
	FUZZ_SECONDS=$(FUZZ_SECONDS) bash scripts/fuzz.sh

fuzz-build:
	$(CMAKE) -S . -B build/fuzz -G Ninja -DNEBULITE_BUILD_FUZZERS=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo \
	  -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_MAKE_PROGRAM=$(NINJA) >/dev/null
	$(NINJA) -C build/fuzz -j $(JOBS)

bench: setup
	$(PY) benchmarks/bench_suite.py $(BENCH_ARGS)

# Persisting to and loading from each object store's emulator, against its client used directly.
bench-stores: setup
	$(PY) benchmarks/bench_object_stores.py $(BENCH_ARGS)

# docs/reliability.md: the fault-injection sweep with 1, 2 and 3 ranks, then the kill campaign
# (SIGKILLs trainers and node agents at random moments and checks the store after each kill).
# RELIABILITY_ARGS="--seed N" reruns a campaign.
reliability: setup test-cpp-build
	NEBULITE_FAULT_SWEEP_RANKS=1,2,3 ./build/tests/nebulite_tests --gtest_filter='*FaultSweep*' \
	  --gtest_brief=1 | grep -v '^Running main'
	$(PY) tests/kill_campaign.py --kills $(RELIABILITY_KILLS) $(RELIABILITY_ARGS)

format:
	clang-format -i $$(git ls-files 'cpp/*.h' 'cpp/*.cc' 'bindings/*.h' 'bindings/*.cc' 'fuzz/*.cc')

clean:
	rm -rf build .venv
