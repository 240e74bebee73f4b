# Convenience targets; the scripts are the source of truth.
PREFIX ?= /usr/local
.PHONY: build bench test install deb wheel image package-check
build:
	cargo build --release
bench:
	scripts/bench.sh
test:
	scripts/test.sh
# Installs the plugin under every file name NCCL tries for
# NCCL_NET_PLUGIN=rustnet / =librustnet / =librustnet.so, and the tool.
install: build
	install -d $(DESTDIR)$(PREFIX)/lib $(DESTDIR)$(PREFIX)/bin
	install -m 755 target/release/librustnet.so $(DESTDIR)$(PREFIX)/lib/librustnet.so
	ln -sf librustnet.so $(DESTDIR)$(PREFIX)/lib/libnccl-net-rustnet.so
	ln -sf librustnet.so $(DESTDIR)$(PREFIX)/lib/libnccl-net-librustnet.so
	install -m 755 target/release/rustnet $(DESTDIR)$(PREFIX)/bin/rustnet
	@echo "installed; put $(PREFIX)/lib on LD_LIBRARY_PATH and set NCCL_NET_PLUGIN=rustnet"

# Packages (out/pkg/); docs: README "Packaging", docs/containers-kubernetes.md, docs/pytorch-ddp.md.
deb: build
	packaging/deb/build-deb.sh out/pkg
wheel: build
	python3 packaging/wheel/build_wheel.py --out out/pkg
image: build
	packaging/container/build-image.sh "$$(packaging/deb/build-deb.sh out/pkg)" out/pkg
# Everything CI checks about them (installs, runs, manifests); see the script's header.
package-check:
	scripts/package-check.sh
