# libvmmipc — build, test, demo, install. `make help` lists the targets.
#
# The library is built by the Go toolchain (go build -buildmode=c-shared);
# CMake builds and runs the C tests through ctest and installs the package.

GO        ?= go
CC        ?= cc
PYTHON    ?= python3
PREFIX    ?= /usr/local
BUILD     ?= build
LIB       := $(BUILD)/libvmmipc.so
CMAKE_DIR := $(BUILD)/cmake
# Only vmmipc_* symbols are exported (export/vmmipc.map); SONAME libvmmipc.so.
GOFLAGS_LIB := -buildmode=c-shared -trimpath \
	-ldflags="-s -extldflags=-Wl,--version-script=$(CURDIR)/export/vmmipc.map,-soname,libvmmipc.so"
GO_SOURCES := $(shell find core cuda export -name '*.go' -o -name '*.c' -o -name '*.h' -o -name '*.map' 2>/dev/null) \
	go.mod go.sum include/vmmipc.h

.PHONY: all lib test test-go test-c test-python test-cgocheck test-install demo bench install deps help clean

all: lib ## build build/libvmmipc.so and build/include/vmmipc.h

lib: $(LIB) ## same as all

$(LIB): $(GO_SOURCES)
	@mkdir -p $(BUILD)/include
	$(GO) build $(GOFLAGS_LIB) -o $@ ./export
	@rm -f $(BUILD)/libvmmipc.h   # cgo's generated header; the contract is include/vmmipc.h
	cp include/vmmipc.h $(BUILD)/include/vmmipc.h
	@bad=$$(nm -D --defined-only $@ | awk '{print $$3}' | grep -v '^vmmipc_' || true); \
	  if [ -n "$$bad" ]; then echo "exported non-vmmipc_ symbols: $$bad"; exit 1; fi

deps: ## check the toolchain and fetch what a fresh machine lacks (Go modules, pytest)
	@for t in $(GO) $(CC) cmake $(PYTHON); do command -v $$t >/dev/null || { echo "missing: $$t"; exit 1; }; done
	@command -v pkg-config >/dev/null || { apt-get update -qq && apt-get install -y -qq pkg-config; } || { echo "missing: pkg-config"; exit 1; }
	$(GO) mod download
	@$(PYTHON) -c 'import pytest' 2>/dev/null || $(PYTHON) -m pip install --quiet pytest

test: deps lib test-go test-c test-python test-cgocheck test-install ## run every test: Go (race), C (ctest), Python (pytest), cgocheck2, install
	@echo "make test: all suites passed"

test-go: ## go vet, gofmt and go test -race
	$(GO) vet ./...
	@fmt=$$(gofmt -l core cuda export); if [ -n "$$fmt" ]; then echo "gofmt needed: $$fmt"; exit 1; fi
	$(GO) test -race -count=1 ./...

test-c: ## build the C tests with CMake (library through Go) and run them with ctest
	cmake -S . -B $(CMAKE_DIR) -DCMAKE_BUILD_TYPE=Release -DVMMIPC_BUILD_TESTS=ON >/dev/null
	cmake --build $(CMAKE_DIR) -j2
	ctest --test-dir $(CMAKE_DIR) --output-on-failure --no-tests=error

test-python: lib ## Python shim tests (pytest)
	$(PYTHON) -m pytest -q tests/python

# The C suite again, against a library built with GOEXPERIMENT=cgocheck2 (full
# checks of pointers passed between Go and C). The C tests use RUNPATH, so
# LD_LIBRARY_PATH picks this build. (-race is covered by go test -race: a
# race-instrumented c-shared library cannot load into an uninstrumented host.)
test-cgocheck: test-c ## the C tests against a GOEXPERIMENT=cgocheck2 build of the library
	@mkdir -p $(BUILD)/cgocheck
	GOEXPERIMENT=cgocheck2 $(GO) build $(GOFLAGS_LIB) -o $(BUILD)/cgocheck/libvmmipc.so ./export
	LD_LIBRARY_PATH=$(BUILD)/cgocheck $(CMAKE_DIR)/test_vmmipc all

# Install into a scratch prefix, then build and run a consumer through
# find_package(vmmipc CONFIG) and through pkg-config.
test-install: ## install to a scratch prefix and link a program against it (CMake and pkg-config)
	rm -rf $(BUILD)/install-test
	cmake -S . -B $(BUILD)/install-test/build -DCMAKE_INSTALL_PREFIX=$(CURDIR)/$(BUILD)/install-test/prefix -DVMMIPC_BUILD_TESTS=OFF >/dev/null
	cmake --build $(BUILD)/install-test/build -j2 >/dev/null
	cmake --install $(BUILD)/install-test/build >/dev/null
	cmake -S tests/install -B $(BUILD)/install-test/consumer -DCMAKE_PREFIX_PATH=$(CURDIR)/$(BUILD)/install-test/prefix >/dev/null
	cmake --build $(BUILD)/install-test/consumer >/dev/null
	LD_LIBRARY_PATH=$(BUILD)/install-test/prefix/lib $(BUILD)/install-test/consumer/consumer
	$(CC) tests/install/main.c -o $(BUILD)/install-test/consumer-pc \
	  $$(PKG_CONFIG_PATH=$(BUILD)/install-test/prefix/lib/pkgconfig pkg-config --cflags --libs vmmipc)
	LD_LIBRARY_PATH=$(BUILD)/install-test/prefix/lib $(BUILD)/install-test/consumer-pc

$(BUILD)/vmmipc_demo: tests/c/demo.c tests/c/cuda_dlopen.h tests/c/testutil.h $(LIB)
	$(CC) -O2 -Wall -o $@ tests/c/demo.c -I$(BUILD)/include -L$(BUILD) -lvmmipc -lpthread -ldl -Wl,-rpath,'$$ORIGIN'

demo: deps $(BUILD)/vmmipc_demo ## share a 4096-chunk buffer between two processes (GPU if present, else host)
	$(BUILD)/vmmipc_demo

bench: lib ## driver floor vs libvmmipc vs all-at-once for N = 64..16384 (GPU if present, else host memory) into build/bench/
	bash bench/run.sh --out $(BUILD)/bench

install: ## install library, header, CMake package and vmmipc.pc under PREFIX
	cmake -S . -B $(BUILD)/cmake-install -DCMAKE_INSTALL_PREFIX=$(PREFIX) -DVMMIPC_BUILD_TESTS=OFF >/dev/null
	cmake --build $(BUILD)/cmake-install -j2
	cmake --install $(BUILD)/cmake-install

help: ## list targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/' | expand -t 14

clean: ## remove build outputs
	rm -rf $(BUILD)
