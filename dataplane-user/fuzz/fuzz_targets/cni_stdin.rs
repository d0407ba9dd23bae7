//! The CNI plugin's stdin: the network configuration, its `prevResult`,
//! and the VERSION command's whole path (which touches nothing else).
#![no_main]

use dataplane_user::cni::{
    plugin::{read_conf, read_result, run},
    spec::CniEnv,
};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(conf) = read_conf(data) {
        if let Some(prev) = conf.prev_result.as_deref() {
            if let Ok(result) = read_result(prev) {
                let _ = result.addresses();
                let _ = result.node_side();
            }
        }
    }
    // ADD/DEL/CHECK would dial the agent socket the input names and enter
    // namespaces: not for a fuzzer. VERSION reads stdin only.
    let env = CniEnv::from_vars(|name| (name == "CNI_COMMAND").then(|| "VERSION".to_owned()));
    let outcome = run(&env, data);
    assert!(outcome.success, "VERSION must always answer");
});
