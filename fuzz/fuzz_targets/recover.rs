#![no_main]
// See rustnet::proto::fuzz::recover for what this target asserts.
libfuzzer_sys::fuzz_target!(|data: &[u8]| rustnet::proto::fuzz::recover(data));
