#![no_main]
// See rustnet::proto::fuzz::wire_header for what this target asserts.
libfuzzer_sys::fuzz_target!(|data: &[u8]| rustnet::proto::fuzz::wire_header(data));
