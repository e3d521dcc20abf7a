# The README's commands. Each installs what it needs first (scripts/setup.sh).
PY := .venv/bin/python
JOBS ?= 2
RELIABILITY_KILLS ?= 1000

.PHONY: setup demo test test-cpp-build test-cpp test-py bench reliability format clean

setup:
	bash scripts/setup.sh

demo: setup
	$(PY) examples/demo.py

test: setup test-cpp test-py

test-cpp-build:
	.venv/bin/cmake -S . -B build/tests -G Ninja -DNEBULITE_BUILD_TESTS=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo \
	  -DCMAKE_MAKE_PROGRAM=$(CURDIR)/.venv/bin/ninja >/dev/null
	.venv/bin/ninja -C build/tests -j $(JOBS) nebulite_tests

test-cpp: test-cpp-build
	./build/tests/nebulite_tests --gtest_brief=1

test-py:
	$(PY) -m pytest -q tests

bench: setup
	$(PY) benchmarks/bench_suite.py $(BENCH_ARGS)

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
