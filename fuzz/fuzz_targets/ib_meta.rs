#![no_main]
// See rustnet::proto::fuzz::ib_meta for what this target asserts.
libfuzzer_sys::fuzz_target!(|data: &[u8]| rustnet::proto::fuzz::ib_meta(data));
