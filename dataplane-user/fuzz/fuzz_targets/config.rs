//! The config file parser: size and nesting limits, YAML, validation.
#![no_main]

use dataplane_user::config::LocalConfig;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // The agent reads the file as UTF-8 first (`reload::read_bounded`).
    if let Ok(text) = std::str::from_utf8(data) {
        let _ = LocalConfig::parse(text, "fuzz.yaml");
    }
});
