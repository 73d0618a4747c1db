# libvmmipc — build, test, demo, install. `make help` lists the targets.
#
# CMake owns the library build (CMakeLists.txt: the Go toolchain's flags and
# the exported-symbol check); this Makefile drives it, the tests and the
# examples.

GO        ?= go
CC        ?= cc
PYTHON    ?= python3
PREFIX    ?= /usr/local
BUILD     ?= build
CMAKE_DIR := $(BUILD)/cmake
# CMake finds go on PATH (or in /usr/local/go/bin); `make GO=/path/to/go` overrides it.
GO_FLAG   := $(if $(filter command line environment,$(origin GO)),-DGO_EXECUTABLE=$(GO))
# One CMake build for the library (in $(BUILD)/, as build/libvmmipc.so and
# build/include/vmmipc.h), the C tests, the demo and the cgocheck2 build.
CMAKE_CONFIGURE := cmake -S . -B $(CMAKE_DIR) -DCMAKE_BUILD_TYPE=Release -DVMMIPC_BUILD_TESTS=ON \
	-DVMMIPC_OUTPUT_DIR=$(CURDIR)/$(BUILD) $(GO_FLAG) >/dev/null
INSTALL_TEST := $(BUILD)/install-test
# CMake's generated makefiles run under this make: no "Entering directory" noise.
MAKEFLAGS += --no-print-directory

.PHONY: all lib test test-go test-c test-python test-torch test-cgocheck test-install test-wheel test-editable test-readme \
	demo bench install deps help clean

all: lib ## build build/libvmmipc.so and build/include/vmmipc.h

lib: ## same as all
	@$(CMAKE_CONFIGURE)
	cmake --build $(CMAKE_DIR) --target vmmipc_go

# deps checks the tools a fresh machine must have, and installs what it may
# lack (pkg-config, the Go modules, pytest, numpy), saying so first; nothing
# present is touched. numpy is for the numpy rows of tests/python (a
# HostBuffer seen by numpy without a copy); torch is not installed (a large
# download): its rows skip, saying so (make test-python lists every skip). pip gets --user outside a virtual environment (inside one,
# --user is refused).
PIP_INSTALL = $(PYTHON) -m pip install --quiet$(shell $(PYTHON) -c 'import sys; print("" if sys.prefix != sys.base_prefix else " --user")' 2>/dev/null)
deps: ## check the toolchain; install only what is missing (pkg-config, Go modules, pytest, numpy), saying so first
	@for t in $(GO) $(CC) cmake nm bash $(PYTHON); do \
	  command -v $$t >/dev/null || { echo "make: missing $$t: install it (see README.md, Two commands)"; exit 1; }; done
	@command -v pkg-config >/dev/null || \
	  if command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
	    echo "make: installing pkg-config (missing) with: apt-get update && apt-get install -y pkg-config"; \
	    apt-get update -qq && apt-get install -y -qq pkg-config >/dev/null; \
	  else echo "make: missing pkg-config: install it (Debian/Ubuntu: apt-get install pkg-config)"; exit 1; fi
	@GOPROXY=off $(GO) mod download 2>/dev/null || { \
	  echo "make: fetching the Go modules (missing) with: $(GO) mod download"; $(GO) mod download; }
	@$(PYTHON) -c 'import pytest' 2>/dev/null || { \
	  echo "make: installing pytest (missing) with: $(PIP_INSTALL) pytest"; $(PIP_INSTALL) pytest; } || { \
	  echo "make: could not install pytest: install it yourself (Debian/Ubuntu: apt-get install python3-pytest)"; exit 1; }
	@$(PYTHON) -c 'import numpy' 2>/dev/null || { \
	  echo "make: installing numpy (missing; the numpy rows of tests/python need it) with: $(PIP_INSTALL) numpy"; $(PIP_INSTALL) numpy; } || { \
	  echo "make: could not install numpy: install it yourself (Debian/Ubuntu: apt-get install python3-numpy)"; exit 1; }
	@$(PYTHON) -c 'import venv, ensurepip' 2>/dev/null || { \
	  echo "make: $(PYTHON) has no venv/ensurepip (make test-wheel and test-editable need it): install it (Debian/Ubuntu: apt-get install python3-venv)"; exit 1; }

test: deps lib test-go test-c test-python test-cgocheck test-install test-wheel test-editable test-readme test-torch ## every test: Go, C, Python, torch's DataLoader (VMMIPC_TEST_TORCH=1 installs torch), cgocheck2, the installed package, the examples, the wheel, the editable install, the README's snippets
	@echo "make test: all suites passed"

test-go: ## go vet, gofmt and go test -race
	$(GO) vet ./...
	@fmt=$$(gofmt -l core cuda export); if [ -n "$$fmt" ]; then echo "gofmt needed: $$fmt"; exit 1; fi
	$(GO) test -race -count=1 ./...

test-c: ## build the C tests with CMake and run them with ctest
	@$(CMAKE_CONFIGURE)
	cmake --build $(CMAKE_DIR) -j2
	ctest --test-dir $(CMAKE_DIR) --output-on-failure --no-tests=error

# deps installs numpy, and VMMIPC_TESTS_REQUIRE makes its tests fail rather
# than skip without it; -rs lists every test skipped, with its reason (those
# that need torch, where it is not installed): nothing is skipped silently.
test-python: deps lib ## Python shim tests (pytest; numpy required, lists what it skipped and why)
	VMMIPC_TESTS_REQUIRE=numpy $(PYTHON) -m pytest -q -rs tests/python

# torch's DataLoader and vmmipc.torch's CPU tests need torch, a large
# download that deps does not make. They run under $(PYTHON) when it has
# torch (test-python runs them then), else under $(TORCH_VENV): made and
# filled with $(TORCH_PIP), numpy and pytest by tests/python/torch_venv.py
# (in little disk) when missing, only when VMMIPC_TEST_TORCH=1 (.ci/run sets
# it), saying so first; otherwise, or where the disk cannot hold torch, they
# are skipped, saying why (so does test-python: pytest -rs).
TORCH_VENV := $(BUILD)/torch-venv
TORCH_PIP  ?= torch
VMMIPC_TEST_TORCH ?= 0
TORCH_TESTS := tests/python/test_dataloader.py tests/python/test_torch_cpu.py tests/python/test_torch_host.py
test-torch: lib ## the DataLoader and vmmipc.torch CPU tests under a Python with torch ($(TORCH_VENV), installed there with VMMIPC_TEST_TORCH=1)
	@if $(PYTHON) -c 'import torch' 2>/dev/null; then \
	  echo "make test-torch: $(PYTHON) has torch: test-python runs $(TORCH_TESTS)"; exit 0; fi; \
	if ! $(TORCH_VENV)/bin/python -c 'import torch, numpy, pytest' 2>/dev/null; then \
	  if [ "$(VMMIPC_TEST_TORCH)" != 1 ]; then \
	    echo "make test-torch: SKIPPED $(TORCH_TESTS): no torch for $(PYTHON) nor in $(TORCH_VENV); make test VMMIPC_TEST_TORCH=1 installs it there (.ci/run does)"; exit 0; fi; \
	  echo "make: installing torch (missing) into $(TORCH_VENV): $(TORCH_PIP) numpy pytest, a few GiB (tests/python/torch_venv.py)"; \
	  rm -rf $(TORCH_VENV); $(PYTHON) tests/python/torch_venv.py $(TORCH_VENV) $(TORCH_PIP) numpy pytest; rc=$$?; \
	  if [ $$rc = 3 ]; then echo "make test-torch: SKIPPED $(TORCH_TESTS): this machine has too little disk for torch (above)"; exit 0; fi; \
	  [ $$rc = 0 ] || exit 1; fi; \
	echo "$(TORCH_VENV)/bin/python -m pytest -q -rs $(TORCH_TESTS)"; \
	VMMIPC_TESTS_REQUIRE=numpy $(TORCH_VENV)/bin/python -m pytest -q -rs $(TORCH_TESTS)

# The C suite again, against a library built with GOEXPERIMENT=cgocheck2 (full
# checks of pointers passed between Go and C). The C tests use RUNPATH, so
# LD_LIBRARY_PATH picks this build. (-race is covered by go test -race: a
# race-instrumented c-shared library cannot load into an uninstrumented host.)
test-cgocheck: test-c ## the C tests against a GOEXPERIMENT=cgocheck2 build of the library (quiet unless one fails)
	cmake --build $(CMAKE_DIR) --target vmmipc_go_cgocheck2
	@log=$(BUILD)/cgocheck/test_vmmipc.log; \
	echo "LD_LIBRARY_PATH=$(BUILD)/cgocheck $(CMAKE_DIR)/test_vmmipc all >$$log 2>&1"; \
	if LD_LIBRARY_PATH=$(BUILD)/cgocheck $(CMAKE_DIR)/test_vmmipc all >$$log 2>&1; then \
	  echo "cgocheck2: $$(tail -n 1 $$log) (every test's output: $$log)"; \
	else \
	  status=$$?; cat $$log; \
	  echo "cgocheck2: FAILED (status $$status): the C tests against the cgocheck2 build; output above and in $$log" >&2; \
	  exit 1; \
	fi

# Installs into a scratch prefix (build/install-test/prefix; the GPU machine's
# examples/cuda/run.sh uses it too), then builds every C example against it
# through find_package(vmmipc) and through pkg-config and runs them.
test-install: ## install to a scratch prefix; build and run the examples against it (CMake and pkg-config)
	rm -rf $(INSTALL_TEST)
	cmake -S . -B $(INSTALL_TEST)/build -DCMAKE_INSTALL_PREFIX=$(CURDIR)/$(INSTALL_TEST)/prefix \
	  -DVMMIPC_BUILD_TESTS=OFF $(GO_FLAG) >/dev/null
	cmake --build $(INSTALL_TEST)/build >/dev/null
	cmake --install $(INSTALL_TEST)/build >/dev/null
	bash tests/install/test_examples.sh $(INSTALL_TEST)/prefix $(INSTALL_TEST)/examples

# The wheel's library is not `make lib`'s: zig cc builds it against an older
# glibc (manylinux). After the wheel's own checks, the C suite and the load
# hygiene tests run again against it (RUNPATH: LD_LIBRARY_PATH picks it).
WHEEL_TEST := $(BUILD)/wheel-test
WHEEL_LIB  := $(abspath $(WHEEL_TEST)/lib)
test-wheel: ## pip wheel ./python: a manylinux wheel (auditwheel), installed into a fresh venv without Go, the Python example run from elsewhere, the C suite against its library
	bash tests/install/test_wheel.sh $(PYTHON) $(WHEEL_TEST)
	@$(CMAKE_CONFIGURE)
	cmake --build $(CMAKE_DIR) -j2 --target test_vmmipc test_load_dlopen test_load_linked
	@LD_LIBRARY_PATH=$(WHEEL_LIB) ldd $(CMAKE_DIR)/test_vmmipc | grep -qF "$(WHEEL_LIB)/libvmmipc.so" || \
	  { echo "make: the C tests do not load $(WHEEL_LIB)/libvmmipc.so"; exit 1; }
	LD_LIBRARY_PATH=$(WHEEL_LIB) $(CMAKE_DIR)/test_vmmipc all
	$(CMAKE_DIR)/test_load_dlopen $(WHEEL_LIB)/libvmmipc.so
	LD_LIBRARY_PATH=$(WHEEL_LIB) $(CMAKE_DIR)/test_load_linked parent

test-editable: ## pip install -e ./python into a fresh venv; the Python example from elsewhere loads the editable build's library
	bash tests/install/test_editable.sh $(PYTHON) $(BUILD)/editable-test

test-readme: ## README.md and docs/*.md: code blocks are excerpts of examples/ that compile and import what they use, links lead to files and headings, sections stay short
	$(PYTHON) tests/readme/check_snippets.py

demo: deps ## share a 4096-chunk buffer between two processes (GPU if present, else host)
	@$(CMAKE_CONFIGURE)
	cmake --build $(CMAKE_DIR) --target vmmipc_demo >/dev/null
	$(CMAKE_DIR)/vmmipc_demo

bench: lib ## floor, first and repeated (import-cache) transfers, all-at-once and the Python path at N = 4096 x 2 MiB and 410 x 20 MiB (GPU if present, else host memory) into build/bench/; matplotlib, if missing, into build/bench-venv/
	bash bench/run.sh --out $(BUILD)/bench

install: ## install library, header, CMake package and vmmipc.pc under PREFIX (ldconfig when the loader searches it)
	cmake -S . -B $(BUILD)/cmake-install -DCMAKE_INSTALL_PREFIX=$(PREFIX) -DVMMIPC_BUILD_TESTS=OFF \
	  $(GO_FLAG) >/dev/null
	cmake --build $(BUILD)/cmake-install
	cmake --install $(BUILD)/cmake-install

help: ## list targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/' | expand -t 14

clean: ## remove build outputs
	rm -rf $(BUILD)
