//! Generates Rust bindings for NCCL's net-plugin ABI from our own headers in
//! `nccl-headers/` (`$OUT_DIR/nccl_net.rs`), and the ibverbs *types* from the
//! system's `<infiniband/verbs.h>` (`$OUT_DIR/verbs.rs`; libibverbs-dev) and
//! `<rdma/rdma_cma.h>` (`$OUT_DIR/rdmacm.rs`; librdmacm-dev).
//! Only types and constants are generated for verbs, never function
//! declarations: the libraries are dlopen'ed at run time, so no NEEDED entry
//! on libibverbs or librdmacm can appear.
use std::{env, path::PathBuf};

fn main() {
    let dir = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap()).join("nccl-headers");
    for f in ["nccl_net.h", "err.h", "net_device.h", "net_v6.h", "net_v7.h", "net_v8.h", "net_v9.h", "net_v10.h", "net_v11.h", "net_v12.h"]
    {
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
        .allowlist_type("ncclNetCommAttr_v.*")
        .allowlist_type("ncclNetAttr_v.*")
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
    verbs_types();
}

/// Layouts of the ibverbs structures we hand to libibverbs. Types only: a
/// function declaration here would be an easy way to link libibverbs by
/// accident, so functions are blocked and resolved with dlvsym instead.
fn verbs_types() {
    println!("cargo:rerun-if-changed=/usr/include/infiniband/verbs.h");
    let bindings = bindgen::Builder::default()
        .header_contents("rustnet_verbs.h", "#include <infiniband/verbs.h>\n")
        .allowlist_type("ibv_(device|context|context_ops|device_attr|port_attr|gid|pd|mr|cq|qp|qp_init_attr|qp_cap|qp_attr|ah_attr|global_route|send_wr|recv_wr|sge|wc|async_event|comp_channel|srq)")
        .allowlist_type("ibv_(qp_state|qp_type|access_flags|wr_opcode|send_flags|wc_status|wc_opcode|wc_flags|mtu|port_state|qp_attr_mask|event_type|node_type|transport_type|atomic_cap|mig_state)")
        .allowlist_var("IBV_LINK_LAYER_.*")
        .blocklist_function(".*")
        .constified_enum_module("ibv_(access_flags|send_flags|qp_attr_mask|wc_flags)")
        .default_enum_style(bindgen::EnumVariation::Consts)
        .prepend_enum_name(false)
        .layout_tests(true)
        .derive_default(true)
        .derive_debug(false)
        .generate()
        .expect("bindgen could not parse <infiniband/verbs.h>: install libibverbs-dev (and libclang-dev)");
    let out = PathBuf::from(env::var("OUT_DIR").unwrap()).join("verbs.rs");
    bindings.write_to_file(out).expect("write verbs bindings");
    rdmacm_types();
}

/// Layouts of the librdmacm structures (`<rdma/rdma_cma.h>`, librdmacm-dev)
/// for the iWARP connection path; types only, like [`verbs_types`]. The
/// ibverbs types they point to come from `verbs.rs` (blocklisted here, the
/// including module imports them).
fn rdmacm_types() {
    println!("cargo:rerun-if-changed=/usr/include/rdma/rdma_cma.h");
    let bindings = bindgen::Builder::default()
        .header_contents("rustnet_rdmacm.h", "#include <rdma/rdma_cma.h>\n")
        .allowlist_type("rdma_(cm_id|cm_event|event_channel|conn_param|cm_event_type|port_space)")
        .blocklist_type("ibv_(device|context|context_ops|pd|mr|cq|qp|srq|comp_channel|qp_init_attr|qp_cap|qp_type|qp_state|gid|ah_attr|global_route|mtu|.*_flags|wc.*|send_wr|recv_wr|sge|async_event|event_type|node_type|transport_type|device_attr|port_attr|atomic_cap|mig_state|port_state|qp_attr|qp_attr_mask|wr_opcode)")
        .blocklist_function(".*")
        .default_enum_style(bindgen::EnumVariation::Consts)
        .prepend_enum_name(false)
        .layout_tests(true)
        .derive_default(true)
        .derive_debug(false)
        .wrap_unsafe_ops(true)
        .generate()
        .expect("bindgen could not parse <rdma/rdma_cma.h>: install librdmacm-dev");
    let out = PathBuf::from(env::var("OUT_DIR").unwrap()).join("rdmacm.rs");
    bindings.write_to_file(out).expect("write rdmacm bindings");
}
