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
# Both are installed stripped; their debug info (line tables) lies beside
# them as <name>.debug, named by a .gnu_debuglink, where gdb, perf and
# backtraces find it.
install: build
	install -d $(DESTDIR)$(PREFIX)/lib $(DESTDIR)$(PREFIX)/bin
	objcopy --only-keep-debug target/release/librustnet.so target/release/librustnet.so.debug
	objcopy --strip-debug --strip-unneeded --add-gnu-debuglink=target/release/librustnet.so.debug \
	  target/release/librustnet.so target/release/librustnet.so.stripped
	objcopy --only-keep-debug target/release/rustnet target/release/rustnet.debug
	objcopy --strip-debug --add-gnu-debuglink=target/release/rustnet.debug target/release/rustnet target/release/rustnet.stripped
	install -m 755 target/release/librustnet.so.stripped $(DESTDIR)$(PREFIX)/lib/librustnet.so
	install -m 644 target/release/librustnet.so.debug $(DESTDIR)$(PREFIX)/lib/librustnet.so.debug
	ln -sf librustnet.so $(DESTDIR)$(PREFIX)/lib/libnccl-net-rustnet.so
	ln -sf librustnet.so $(DESTDIR)$(PREFIX)/lib/libnccl-net-librustnet.so
	install -m 755 target/release/rustnet.stripped $(DESTDIR)$(PREFIX)/bin/rustnet
	install -m 644 target/release/rustnet.debug $(DESTDIR)$(PREFIX)/bin/rustnet.debug
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
