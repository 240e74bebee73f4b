#![no_main]
// See rustnet::proto::fuzz::resume_records for what this target asserts.
libfuzzer_sys::fuzz_target!(|data: &[u8]| rustnet::proto::fuzz::resume_records(data));
