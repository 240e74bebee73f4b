#![no_main]
// See rustnet::proto::fuzz::fifo for what this target asserts.
libfuzzer_sys::fuzz_target!(|data: &[u8]| rustnet::proto::fuzz::fifo(data));
