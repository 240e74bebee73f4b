#![no_main]
// See rustnet::proto::fuzz::handle for what this target asserts.
libfuzzer_sys::fuzz_target!(|data: &[u8]| rustnet::proto::fuzz::handle(data));
