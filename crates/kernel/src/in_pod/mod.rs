//! What the agent does inside a pod's network namespace: sockets made
//! there ([`PodNetns`], [`pod_netns::connect`]), TCP keepalive on them
//! ([`keepalive`]), and the policy routing that brings an app's replies
//! back to a proxy connected from the client's address
//! ([`original_source`]). Our engine's pods and those of an external
//! in-pod proxy ([`crate::redirect::ExternalPodCapture`]) both need it.

pub mod keepalive;
pub mod original_source;
pub mod pod_netns;
pub mod source_ports;

pub use pod_netns::PodNetns;
