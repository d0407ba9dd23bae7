//! Kernel-level benchmarks: the same workloads over the same simulated
//! two-node topology with no mesh (`direct`), with Istio-style iptables
//! capture feeding our engine (`iptables`) and with our kernel programs
//! feeding it (`ebpf`), and, given a stock ztunnel, with it in dedicated
//! mode behind the same iptables rules (`ztunnel`); run by `dp-bench`,
//! which `cargo xtask bench` drives and whose samples it turns into the
//! report.
//!
//! [`churn`] measures the traffic of enrolled pods while other pods are
//! enrolled and removed in a loop; [`scale`] measures the mesh state's
//! cost at N workloads against the test istiod. [`mesh`] builds one cluster per mode, [`plan`] decides what runs in
//! which order and records samples, [`probe`] reads CPU and memory,
//! [`iptables`] holds the incumbent's rules, [`dedicated`] runs a stock
//! ztunnel behind them (when given one), [`agent`] and [`process`] own
//! the processes, [`signal`] and [`sweep`] make sure nothing outlives a
//! run, even an interrupted or killed one.

pub mod agent;
pub mod churn;
pub mod dedicated;
pub mod iptables;
pub mod mesh;
pub mod plan;
pub mod probe;
pub mod process;
pub mod scale;
pub mod signal;
pub mod sweep;
