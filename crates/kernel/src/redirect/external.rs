//! Pods served by an external in-pod proxy (Istio's ztunnel, fed over ZDS)
//! instead of our engine: the same capture, aimed at sockets another
//! process owns.
//!
//! - **Outbound** is unchanged: `connect4`/`connect6` send the pod's
//!   connections to `127.0.0.1:15001`, where the proxy's dual-stack
//!   `[::]:15001` accepts them, and `cgroup/getsockopt` answers its
//!   `SO_ORIGINAL_DST` (`SOL_IP` on the IPv4-mapped accepted socket).
//! - **Inbound**: `sk_lookup` hands connections to the proxy's `[::]:15006`
//!   and `[::]:15008`, whose copies the agent takes from the proxy process
//!   ([`super::harvest`]) and registers with
//!   [`Redirector::set_pod_listeners`]. The accepted socket's local address
//!   is the original destination, which is what ztunnel checks.
//! - **The proxy's connection to the app**, from the client's address with
//!   the proxy mark: `dp_proxy_syn` on the pod's `lo` records its SYN for
//!   `sk_lookup` and gives it the transparent mark, and the pod's original
//!   source routing (`crate::in_pod::original_source::SourceRouting`, which the
//!   caller installs) brings the app's replies back to the proxy.
//!
//! Order: [`Redirector::enroll_external_pod`] first (capture and the `lo`
//! program; outbound capture waits for listeners: the namespace is not
//! `ENGINE_READY`), hand the namespace to the proxy, harvest its listeners
//! once it acknowledged the pod, then [`Redirector::set_pod_listeners`]
//! (marks the namespace `ENGINE_READY`). When the proxy closes its sockets
//! (it exits or restarts) the kernel drops their `LISTENERS` entries at
//! once and inbound connections meet the fail-open/fail-closed setting;
//! outbound ones are refused (nothing listens on 15001) until
//! [`Redirector::clear_pod_listeners`] clears `ENGINE_READY` (then the
//! setting applies to them too) or a new harvest is registered.

use std::{
    net::IpAddr,
    os::fd::{AsFd, BorrowedFd},
};

use dataplane_common::{ENROLLED_ENGINE_READY, maps::ENROLLED_NETNS, maps::LISTENERS};
use tracing::info;

use super::{
    RedirectError, Redirector,
    harvest::{HarvestError, HarvestedListener, harvest_listeners},
    kernel_maps::{absent_as_none, ignore_missing},
    pods::{Exclusions, Registration, RoleListeners, listener_keys},
    proxy_syn,
};

/// `BPF_EXIST`: update only an existing element.
const BPF_EXIST: u64 = 2;

/// Everything the kernel needs to capture one pod whose in-pod listeners
/// belong to an external proxy (no listeners: they come later, from
/// [`ExternalListeners::harvest`]).
#[derive(Debug, Clone, Copy)]
pub struct ExternalPodCapture<'a> {
    /// Cookie of the pod's network namespace.
    pub netns_cookie: u64,
    /// The pod's network-namespace file: the `sk_lookup` link, and `lo`
    /// for `dp_proxy_syn`.
    pub netns: BorrowedFd<'a>,
    /// The pod's IPs (inbound capture is keyed by them).
    pub ips: &'a [IpAddr],
    /// The node-side address toward the pod (the probe source), if any.
    pub node_addr: Option<IpAddr>,
    /// Ports and CIDRs the pod excludes from capture.
    pub exclusions: &'a Exclusions,
    /// Capture the pod's DNS into the resolver on the agent's DNS port
    /// (ztunnel's DNS proxy listens there too).
    pub dns_capture: bool,
}

/// The external proxy's inbound and HBONE listeners in one pod, copied
/// from its process.
#[derive(Debug)]
pub struct ExternalListeners {
    /// Listening on the inbound plaintext port (`[::]:15006`).
    pub inbound: HarvestedListener,
    /// Listening on the HBONE port (`[::]:15008`).
    pub hbone: HarvestedListener,
}

impl ExternalListeners {
    /// Copies the listeners the process `pid` has on `inbound_port` and
    /// `hbone_port` in the network namespace `netns` (see
    /// [`harvest_listeners`]). Blocking; run it on the enrollment thread.
    pub fn harvest(
        pid: u32,
        netns: BorrowedFd<'_>,
        inbound_port: u16,
        hbone_port: u16,
    ) -> Result<Self, HarvestError> {
        let mut found = harvest_listeners(pid, netns, &[inbound_port, hbone_port])?;
        let mut take = |port: u16| {
            let at = found.iter().position(|l| l.local.port() == port);
            at.map(|at| found.swap_remove(at))
                .ok_or(HarvestError::NoListener { pid, port })
        };
        let inbound = take(inbound_port)?;
        let hbone = take(hbone_port)?;
        Ok(Self { inbound, hbone })
    }

    /// The two sockets by role.
    pub(crate) fn roles(&self) -> RoleListeners<'_> {
        RoleListeners {
            inbound: self.inbound.socket.as_fd(),
            hbone: self.hbone.socket.as_fd(),
        }
    }
}

impl Redirector {
    /// The role ports the proxy's inbound listeners must have
    /// (`(inbound, hbone)`: 15006 and 15008 unless configured otherwise).
    pub fn role_ports(&self) -> (u16, u16) {
        (self.config.inbound_port, self.config.hbone_port)
    }

    /// Captures a pod served by an external proxy: attaches `dp_proxy_syn`
    /// to the pod's `lo`, then everything [`Redirector::enroll_pod`] writes
    /// but the listeners. Listeners registered before for IPs the pod still
    /// has are kept. Idempotent.
    ///
    /// Call from the thread that owns the redirector (the enrollment
    /// thread): it briefly joins the pod's namespace on a thread of its own.
    pub fn enroll_external_pod(
        &mut self,
        pod: &ExternalPodCapture<'_>,
    ) -> Result<(), RedirectError> {
        proxy_syn::attach(&mut self.ebpf, pod.netns_cookie, pod.netns)?;
        self.enroll_with(pod, None, super::pods::Server::External)
    }

    /// Registers (or replaces) the pod's inbound listeners for every one of
    /// its IPs, and marks its namespace `ENGINE_READY` (outbound capture
    /// on). The sockets must be listening TCP sockets able to take every
    /// pod IP; anything else is refused before any state is written.
    ///
    /// Takes the copies and closes them once registered: a copy kept open
    /// would keep the socket listening after the proxy exits, and
    /// connections would queue on it unanswered instead of meeting the
    /// fail-open/fail-closed setting.
    pub fn set_pod_listeners(
        &mut self,
        netns_cookie: u64,
        listeners: ExternalListeners,
    ) -> Result<(), RedirectError> {
        self.register_listeners(netns_cookie, listeners.roles())
    }

    fn register_listeners(
        &mut self,
        netns_cookie: u64,
        listeners: RoleListeners<'_>,
    ) -> Result<(), RedirectError> {
        let registered = self.registration(netns_cookie)?;
        if registered.ips.is_empty() {
            return Err(RedirectError::NotEnrolled { netns_cookie });
        }
        let ips: Vec<IpAddr> = registered.ips.iter().map(super::keys::ip_of).collect();
        self.check_listeners(&ips, listeners)?;
        let keys = listener_keys(&registered.ips, &self.config, self.ipv6_listeners);
        let mut known = registered;
        known.listeners.extend(&keys);
        self.registry.insert(netns_cookie, known.clone());
        self.write_listeners(&keys, listeners)?;
        if !self.set_ready(netns_cookie, true)? {
            return Err(RedirectError::NotEnrolled { netns_cookie });
        }
        known.listeners = keys;
        self.registry.insert(netns_cookie, known);
        info!(netns_cookie, "external proxy listeners registered");
        Ok(())
    }

    /// Removes the pod's inbound listeners (the proxy went away) and clears
    /// `ENGINE_READY`: until the next [`Redirector::set_pod_listeners`] the
    /// pod's connections meet the fail-open/fail-closed setting. Idempotent.
    pub fn clear_pod_listeners(&mut self, netns_cookie: u64) -> Result<(), RedirectError> {
        let mut registered = self.registration(netns_cookie)?;
        self.set_ready(netns_cookie, false)?;
        for key in &registered.listeners {
            // Not another pod's since (IPs are reused).
            if self
                .maps
                .pod_inbound_of(&key.pod_addr)?
                .is_some_and(|pod| pod.netns_cookie == netns_cookie)
            {
                ignore_missing(self.maps.listeners.remove(key), LISTENERS)?;
            }
        }
        registered.listeners.clear();
        self.registry.insert(netns_cookie, registered);
        info!(netns_cookie, "external proxy listeners removed");
        Ok(())
    }

    /// Stops capturing a pod served by an external proxy: removes the
    /// `lo` program when the namespace is still there (`netns`), then
    /// everything [`Redirector::unenroll_pod`] removes. Idempotent.
    pub fn unenroll_external_pod(
        &mut self,
        netns_cookie: u64,
        netns: Option<BorrowedFd<'_>>,
    ) -> Result<(), RedirectError> {
        if let Some(netns) = netns {
            proxy_syn::detach(netns_cookie, netns)?;
        }
        self.unenroll_pod(netns_cookie)
    }

    /// What the pod registered (scanned from the maps after a restart).
    fn registration(&self, netns_cookie: u64) -> Result<Registration, RedirectError> {
        match self.registry.get(&netns_cookie) {
            Some(registered) => Ok(registered.clone()),
            None => Registration::scan(&self.maps, netns_cookie),
        }
    }

    /// Sets or clears `ENGINE_READY` of one enrolled namespace; `false`
    /// when it is not enrolled.
    fn set_ready(&mut self, netns_cookie: u64, ready: bool) -> Result<bool, RedirectError> {
        let current = absent_as_none(self.maps.enrolled.get(&netns_cookie, 0), ENROLLED_NETNS)?;
        let Some(mut value) = current else {
            return Ok(false);
        };
        if ready {
            value.flags |= ENROLLED_ENGINE_READY;
        } else {
            value.flags &= !ENROLLED_ENGINE_READY;
        }
        ignore_missing(
            self.maps.enrolled.insert(netns_cookie, value, BPF_EXIST),
            ENROLLED_NETNS,
        )?;
        Ok(true)
    }
}
