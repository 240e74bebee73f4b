//! Generates Rust bindings for NCCL's net-plugin ABI from our own headers in
//! `nccl-headers/`. Output goes to `$OUT_DIR/nccl_net.rs` only.
use std::{env, path::PathBuf};

fn main() {
    let dir = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap()).join("nccl-headers");
    for f in [
        "nccl_net.h",
        "err.h",
        "net_device.h",
        "net_v6.h",
        "net_v7.h",
        "net_v8.h",
        "net_v9.h",
        "net_v10.h",
    ] {
        println!("cargo:rerun-if-changed={}", dir.join(f).display());
    }
    let bindings = bindgen::Builder::default()
        .header(dir.join("nccl_net.h").to_string_lossy())
        .clang_arg(format!("-I{}", dir.display()))
        .allowlist_type("ncclNet_v.*")
        .allowlist_type("ncclNetProperties_v.*")
        .allowlist_type("ncclNetVDeviceProps_v.*")
        .allowlist_type("ncclNetCommConfig_v.*")
        .allowlist_type("ncclNetDeviceHandle_v.*")
        .allowlist_type("ncclResult_t")
        .allowlist_type("ncclDebugLogger_t")
        .allowlist_type("ncclDebugLogLevel")
        .allowlist_type("ncclDebugLogSubSys")
        .allowlist_type("ncclProfilerCallback_t")
        .allowlist_var("NCCL_.*")
        .rustified_enum("ncclResult_t")
        .constified_enum_module("ncclDebugLogLevel")
        .constified_enum_module("ncclDebugLogSubSys")
        .constified_enum_module("ncclNetDeviceType")
        .layout_tests(true)
        .derive_debug(true)
        .derive_default(true)
        .generate()
        .expect("bindgen could not parse nccl-headers/nccl_net.h (is libclang installed?)");
    let out = PathBuf::from(env::var("OUT_DIR").unwrap()).join("nccl_net.rs");
    bindings.write_to_file(out).expect("write bindings");
}
