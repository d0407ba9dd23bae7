//! Which received descriptor is which pod's which listener, and the checks
//! a new agent makes before it serves one: a TCP socket, listening, bound
//! to the address its role says, in the network namespace its pod has.
//! A descriptor that fails any check is closed; the pod then gets new
//! listeners (or, when the old ones are still bound, cannot be taken over,
//! and the hand-over is abandoned).

use std::{
    net::{Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener},
    os::fd::{AsFd, BorrowedFd, OwnedFd},
};

use dataplane_common::{HBONE_PORT, INBOUND_PLAINTEXT_PORT, OUTBOUND_PORT};
use serde::{Deserialize, Serialize};

use crate::proxy::{PodListeners, bind_wildcard};

/// What one passed listening socket is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(super) enum Role {
    /// `127.0.0.1:15001`: captured outbound IPv4.
    OutboundV4,
    /// `[::1]:15001`: captured outbound IPv6.
    OutboundV6,
    /// `[::]:15006` (`0.0.0.0:15006` with IPv6 off): inbound plaintext.
    Inbound,
    /// `[::]:15008` (`0.0.0.0:15008` with IPv6 off): HBONE.
    Hbone,
}

impl Role {
    /// The address a listener of this role is bound to by an agent whose
    /// `--ipv6-enabled` is `ipv6` ([`PodListeners::create`]); `None`: an
    /// agent with IPv6 off has no listener of this role.
    fn address(self, ipv6: bool) -> Option<SocketAddr> {
        match self {
            Self::OutboundV4 => Some(SocketAddr::new(Ipv4Addr::LOCALHOST.into(), OUTBOUND_PORT)),
            Self::OutboundV6 => {
                ipv6.then(|| SocketAddr::new(Ipv6Addr::LOCALHOST.into(), OUTBOUND_PORT))
            }
            Self::Inbound => Some(SocketAddr::new(bind_wildcard(ipv6), INBOUND_PLAINTEXT_PORT)),
            Self::Hbone => Some(SocketAddr::new(bind_wildcard(ipv6), HBONE_PORT)),
        }
    }
}

/// A pod's listeners as `(role, descriptor)`, in the order they are sent.
pub(super) fn roles_of(listeners: &PodListeners) -> Vec<(Role, BorrowedFd<'_>)> {
    let mut out = vec![(Role::OutboundV4, listeners.outbound_v4.as_fd())];
    if let Some(v6) = &listeners.outbound_v6 {
        out.push((Role::OutboundV6, v6.as_fd()));
    }
    out.push((Role::Inbound, listeners.inbound.as_fd()));
    out.push((Role::Hbone, listeners.hbone.as_fd()));
    out
}

/// Rebuilds a pod's listeners from the descriptors received for `roles`,
/// each checked against its role, `netns_cookie` and this agent's
/// `--ipv6-enabled` (`ipv6`); the reason when any is missing or fails.
pub(super) fn listeners_from(
    roles: &[Role],
    fds: Vec<OwnedFd>,
    netns_cookie: u64,
    ipv6: bool,
) -> Result<PodListeners, String> {
    if roles.len() != fds.len() {
        return Err(format!(
            "{} descriptors came for {} roles",
            fds.len(),
            roles.len()
        ));
    }
    let (mut outbound_v4, mut outbound_v6, mut inbound, mut hbone) = (None, None, None, None);
    for (role, fd) in roles.iter().zip(fds) {
        check(*role, fd.as_fd(), netns_cookie, ipv6)
            .map_err(|reason| format!("{role:?}: {reason}"))?;
        let slot = match role {
            Role::OutboundV4 => &mut outbound_v4,
            Role::OutboundV6 => &mut outbound_v6,
            Role::Inbound => &mut inbound,
            Role::Hbone => &mut hbone,
        };
        if slot.replace(TcpListener::from(fd)).is_some() {
            return Err(format!("{role:?} came twice"));
        }
    }
    let missing = |role: Role| format!("no {role:?} listener");
    Ok(PodListeners {
        outbound_v4: outbound_v4.ok_or_else(|| missing(Role::OutboundV4))?,
        outbound_v6,
        inbound: inbound.ok_or_else(|| missing(Role::Inbound))?,
        hbone: hbone.ok_or_else(|| missing(Role::Hbone))?,
    })
}

/// The address of the first of `fds` (received for `roles`) bound in
/// another IP family than an agent whose `--ipv6-enabled` is `ipv6` binds
/// that role: a running agent with another setting.
pub(super) fn family_mismatch(roles: &[Role], fds: &[OwnedFd], ipv6: bool) -> Option<SocketAddr> {
    roles.iter().zip(fds).find_map(|(role, fd)| {
        let bound = socket2::SockRef::from(fd).local_addr().ok()?.as_socket()?;
        match role.address(ipv6) {
            Some(expected) if expected.is_ipv6() == bound.is_ipv6() => None,
            _ => Some(bound),
        }
    })
}

/// Why `fd` cannot serve `role` in the namespace `netns_cookie` for an
/// agent whose `--ipv6-enabled` is `ipv6`.
fn check(role: Role, fd: BorrowedFd<'_>, netns_cookie: u64, ipv6: bool) -> Result<(), String> {
    let expected = role
        .address(ipv6)
        .ok_or("an IPv6 listener, and this agent runs with --ipv6-enabled false")?;
    let socket = socket2::SockRef::from(&fd);
    let fail = |what: &str, e: std::io::Error| format!("cannot read its {what}: {e}");
    if socket.r#type().map_err(|e| fail("type", e))? != socket2::Type::STREAM
        || socket.protocol().map_err(|e| fail("protocol", e))? != Some(socket2::Protocol::TCP)
    {
        return Err("not a TCP socket".into());
    }
    if !socket.is_listener().map_err(|e| fail("SO_ACCEPTCONN", e))? {
        return Err("not listening".into());
    }
    let bound = socket
        .local_addr()
        .map_err(|e| fail("address", e))?
        .as_socket()
        .ok_or("not an internet socket")?;
    if bound != expected {
        // Most likely the running agent's --ipv6-enabled differs from ours.
        return Err(format!(
            "bound to {bound}, not {expected} (this agent runs with --ipv6-enabled {ipv6}; \
             hand over between agents with the same setting)"
        ));
    }
    let cookie = crate::netns::socket_netns_cookie(fd).map_err(|e| fail("namespace", e))?;
    if cookie != netns_cookie {
        return Err(format!(
            "it lives in network namespace {cookie}, not the pod's {netns_cookie}"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    //! Real sockets in a network namespace of the test's own (needs
    //! CAP_SYS_ADMIN, as every test of the agent does).

    use std::net::{Ipv6Addr, SocketAddr};

    use socket2::{Domain, Protocol, Socket, Type};

    use super::*;

    /// Runs `f` on a thread in a new network namespace (gone with it).
    fn in_new_netns<T: Send + 'static>(f: impl FnOnce(u64) -> T + Send + 'static) -> T {
        std::thread::spawn(move || {
            nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET)
                .expect("unshare(CLONE_NEWNET) needs CAP_SYS_ADMIN");
            let cookie = crate::netns::current_netns_cookie().expect("netns cookie");
            f(cookie)
        })
        .join()
        .expect("test thread")
    }

    fn tcp(port: u16, listen: bool) -> OwnedFd {
        let socket = Socket::new(Domain::IPV6, Type::STREAM, Some(Protocol::TCP)).expect("socket");
        socket.set_only_v6(false).expect("dual-stack");
        let addr = SocketAddr::new(Ipv6Addr::UNSPECIFIED.into(), port);
        socket.bind(&addr.into()).expect("bind");
        if listen {
            socket.listen(8).expect("listen");
        }
        socket.into()
    }

    #[test]
    fn a_listener_passes_only_for_its_role_and_namespace() {
        in_new_netns(|cookie| {
            let inbound = tcp(INBOUND_PLAINTEXT_PORT, true);
            assert_eq!(check(Role::Inbound, inbound.as_fd(), cookie, true), Ok(()));
            let wrong_role = check(Role::Hbone, inbound.as_fd(), cookie, true);
            assert!(
                wrong_role.as_ref().is_err_and(|e| e.contains("bound to")),
                "{wrong_role:?}"
            );
            let wrong_netns = check(Role::Inbound, inbound.as_fd(), cookie + 1, true);
            assert!(
                wrong_netns
                    .as_ref()
                    .is_err_and(|e| e.contains("network namespace")),
                "{wrong_netns:?}"
            );
            let idle = tcp(HBONE_PORT, false);
            assert_eq!(
                check(Role::Hbone, idle.as_fd(), cookie, true),
                Err("not listening".to_owned())
            );
            let udp = Socket::new(Domain::IPV6, Type::DGRAM, None).expect("udp");
            assert_eq!(
                check(Role::Hbone, udp.as_fd(), cookie, true),
                Err("not a TCP socket".to_owned())
            );
        });
    }

    #[test]
    fn a_listener_must_be_bound_as_the_agents_ipv6_setting_says() {
        in_new_netns(|cookie| {
            // What an agent with IPv6 on hands over, to one with it off.
            let dual = tcp(INBOUND_PLAINTEXT_PORT, true);
            let refused = check(Role::Inbound, dual.as_fd(), cookie, false);
            assert!(
                refused.as_ref().is_err_and(
                    |e| e.contains("not 0.0.0.0:15006") && e.contains("--ipv6-enabled false")
                ),
                "{refused:?}"
            );
            let outbound_v6 = check(Role::OutboundV6, dual.as_fd(), cookie, false);
            assert!(
                outbound_v6
                    .as_ref()
                    .is_err_and(|e| e.contains("--ipv6-enabled false")),
                "{outbound_v6:?}"
            );
            // What an agent with IPv6 off hands over.
            let v4 = Socket::new(Domain::IPV4, Type::STREAM, Some(Protocol::TCP)).expect("socket");
            let addr = SocketAddr::new(std::net::Ipv4Addr::UNSPECIFIED.into(), HBONE_PORT);
            v4.bind(&addr.into()).expect("bind");
            v4.listen(8).expect("listen");
            assert_eq!(check(Role::Hbone, v4.as_fd(), cookie, false), Ok(()));
            let refused = check(Role::Hbone, v4.as_fd(), cookie, true);
            assert!(
                refused.as_ref().is_err_and(
                    |e| e.contains("not [::]:15008") && e.contains("--ipv6-enabled true")
                ),
                "{refused:?}"
            );
            // Which makes a hand-over between the two a refusal.
            let v4: OwnedFd = v4.into();
            let one = |fd| std::slice::from_ref(fd);
            assert_eq!(family_mismatch(&[Role::Hbone], one(&v4), false), None);
            assert_eq!(family_mismatch(&[Role::Hbone], one(&v4), true), Some(addr));
            assert_eq!(family_mismatch(&[Role::Inbound], one(&dual), true), None);
            assert_eq!(
                family_mismatch(&[Role::Inbound], one(&dual), false),
                Some(SocketAddr::new(
                    Ipv6Addr::UNSPECIFIED.into(),
                    INBOUND_PLAINTEXT_PORT
                ))
            );
        });
    }

    #[test]
    fn a_pod_without_every_listener_is_refused() {
        in_new_netns(|cookie| {
            let fds = vec![tcp(INBOUND_PLAINTEXT_PORT, true), tcp(HBONE_PORT, true)];
            let missing = listeners_from(&[Role::Inbound, Role::Hbone], fds, cookie, true);
            assert!(
                missing
                    .as_ref()
                    .is_err_and(|e| e.contains("no OutboundV4 listener")),
                "{missing:?}"
            );
            let fds = vec![tcp(INBOUND_PLAINTEXT_PORT, true)];
            let uneven = listeners_from(&[Role::Inbound, Role::Hbone], fds, cookie, true);
            assert!(uneven.is_err(), "{uneven:?}");
        });
    }
}
