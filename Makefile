# libvmmipc — build, test, demo, install. `make help` lists the targets.
#
# The library is built by the Go toolchain (go build -buildmode=c-shared);
# CMake builds and runs the C tests through ctest and installs the package.

GO        ?= go
PREFIX    ?= /usr/local
BUILD     ?= build
LIB       := $(BUILD)/libvmmipc.so
GOFLAGS_LIB := -buildmode=c-shared -trimpath \
	-ldflags="-s -extldflags=-Wl,--version-script=$(CURDIR)/export/vmmipc.map"
GO_SOURCES := $(shell find core cuda export -name '*.go' -o -name '*.c' -o -name '*.h' -o -name '*.map' 2>/dev/null) go.mod go.sum include/vmmipc.h

.PHONY: all lib test test-go test-c test-python demo install help clean deps

all: lib ## build build/libvmmipc.so and build/include/vmmipc.h

lib: $(LIB)

$(LIB): $(GO_SOURCES)
	@mkdir -p $(BUILD)/include
	$(GO) build $(GOFLAGS_LIB) -o $@ ./export
	@rm -f $(BUILD)/libvmmipc.h   # cgo's generated header is not the contract
	cp include/vmmipc.h $(BUILD)/include/vmmipc.h

help: ## list targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/' | expand -t 16

clean: ## remove build outputs
	rm -rf $(BUILD)
