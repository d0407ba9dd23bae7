//! The kernel side of the redirection model, end to end in the running
//! kernel: `connect4`/`connect6` + `sockops` (outbound capture and original
//! destination), `getsockopt(SO_ORIGINAL_DST)`, `getpeername`, and the
//! per-pod `sk_lookup` (inbound capture), driven through the redirector's
//! enrollment API.
//!
//! Each test runs on a [`RedirectorNode`](dataplane_tests::redirector_node):
//! one simulated node with pods `app` (under test), `peer` and `other`, an
//! in-process redirector at the node's cgroup, and the test playing the
//! app pod's engine.

#[path = "redirect_kernel/outbound.rs"]
mod outbound;

#[path = "redirect_kernel/inbound.rs"]
mod inbound;

#[path = "redirect_kernel/life_cycle.rs"]
mod life_cycle;

use std::{
    fs::File,
    io::{Read, Write},
    net::{IpAddr, Ipv6Addr, SocketAddr, TcpListener, TcpStream},
    os::fd::{AsFd, AsRawFd},
    process::Command,
};

use aya::maps::{HashMap as BpfHashMap, MapData};
use dataplane_common::{
    CapturedDst, DEFAULT_PROXY_MARK, OrigDst, OrigDstKey, SO_ORIGINAL_DST, SOL_IP, SOL_IPV6,
    maps as m,
};
use dataplane_tests::{
    ChildGuard, probe_binary,
    redirector_node::{
        APP_PORT, LIMIT, RedirectorNode, accept_one, assert_eperm, assert_refused, at, dial,
        dial_in, listener_in_pod, mapped, open_map, pod_entries, sk_lookup_links,
    },
    spawn_in,
    topology::Pod,
    traffic::wait_until,
};
use dataplane_user::{
    features,
    redirect::{Exclusions, ExitMode, PodCapture, Redirector, RedirectorOptions},
};

/// `getsockopt(level, SO_ORIGINAL_DST)` with a buffer of `len` bytes.
fn original_dst(stream: &TcpStream, level: i32, len: usize) -> std::io::Result<SocketAddr> {
    let mut buf = [0u8; 64];
    let mut optlen = len.min(buf.len()) as libc::socklen_t;
    // SAFETY: the buffer outlives the call and `optlen` never exceeds it.
    let rc = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            level,
            SO_ORIGINAL_DST,
            buf.as_mut_ptr().cast(),
            &mut optlen,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let family = i32::from(u16::from_ne_bytes([buf[0], buf[1]]));
    let port = u16::from_be_bytes([buf[2], buf[3]]);
    match (family, optlen) {
        (libc::AF_INET, 16) => Ok(SocketAddr::new(
            IpAddr::from([buf[4], buf[5], buf[6], buf[7]]),
            port,
        )),
        (libc::AF_INET6, 28) => {
            let mut octets = [0u8; 16];
            octets.copy_from_slice(&buf[8..24]);
            Ok(SocketAddr::new(IpAddr::from(octets), port))
        }
        _ => Err(std::io::Error::other(format!(
            "unexpected answer: family {family}, length {optlen}"
        ))),
    }
}

/// An integer socket option.
fn int_option(stream: &TcpStream, level: i32, name: i32) -> std::io::Result<(i32, u32)> {
    let mut value: i32 = 0;
    let mut len = std::mem::size_of::<i32>() as libc::socklen_t;
    // SAFETY: a valid descriptor and a buffer of the size passed.
    let rc = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            level,
            name,
            (&raw mut value).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok((value, len))
}
