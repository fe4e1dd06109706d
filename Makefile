# pdserve: the two commands are `make serve` and `make test` (see README.md).
BUILD_DIR ?= build
JOBS ?= $(shell nproc)
CMAKE_FLAGS ?=
# ccache: share hits between clones in different folders (CI builds a fresh clone).
export CCACHE_BASEDIR := $(CURDIR)
export CCACHE_NOHASHDIR := 1

.PHONY: all setup configure build test serve bench clean

all: build

# Installs what is missing (Debian packages, pinned npm test dependencies). Idempotent.
setup:
	@bash scripts/setup

configure: setup
	@if [ ! -f $(BUILD_DIR)/build.ninja ]; then \
	  cmake -S . -B $(BUILD_DIR) -G Ninja $(CMAKE_FLAGS); \
	fi

build: configure
	cmake --build $(BUILD_DIR) -j $(JOBS)

# Builds everything and runs every test through ctest.
test: build
	cd $(BUILD_DIR) && ctest --output-on-failure -j $(JOBS) --timeout 600

# Builds only the programs a local cluster runs (a fresh clone compiles no test first).
serve: configure
	cmake --build $(BUILD_DIR) -j $(JOBS) --target pdserve-cluster
	$(BUILD_DIR)/bin/pdserve up

clean:
	rm -rf $(BUILD_DIR)
