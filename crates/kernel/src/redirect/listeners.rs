//! Checks on the engine's listener sockets before they go into `LISTENERS`,
//! so that a socket `sk_lookup` could not use is refused with a reason at
//! enrollment instead of silently refusing the pod's inbound connections.

use std::os::fd::BorrowedFd;

use super::RedirectError;

/// Why a listener cannot serve a pod.
pub(crate) fn check(
    socket: BorrowedFd<'_>,
    port: u16,
    serves_v4: bool,
    serves_v6: bool,
) -> Result<(), RedirectError> {
    let unusable = |reason: &'static str| RedirectError::UnusableListener { port, reason };
    let read = |level, name| {
        crate::sockopt::int(socket, level, name)
            .map_err(|source| RedirectError::InspectListener { port, source })
    };
    if read(libc::SOL_SOCKET, libc::SO_PROTOCOL)? != libc::IPPROTO_TCP {
        return Err(unusable("not a TCP socket"));
    }
    if read(libc::SOL_SOCKET, libc::SO_ACCEPTCONN)? == 0 {
        return Err(unusable("not listening (call listen() first)"));
    }
    match read(libc::SOL_SOCKET, libc::SO_DOMAIN)? {
        libc::AF_INET if serves_v6 => Err(unusable(
            "an IPv4 socket cannot take the pod's IPv6 connections (bind [::] instead)",
        )),
        libc::AF_INET6 if serves_v4 && read(libc::IPPROTO_IPV6, libc::IPV6_V6ONLY)? != 0 => Err(
            unusable("an IPV6_V6ONLY socket cannot take the pod's IPv4 connections"),
        ),
        _ => Ok(()),
    }
}
