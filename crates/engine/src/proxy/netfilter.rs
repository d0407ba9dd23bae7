//! The original destination as netfilter knows it, for connections that
//! reached a listener through an iptables `REDIRECT` rather than through our
//! kernel programs (Istio's classic capture, used as the baseline in the
//! benchmarks): `getsockopt(SO_ORIGINAL_DST)` answered from conntrack.

use std::{
    io,
    net::{Ipv4Addr, Ipv6Addr, SocketAddr},
    os::fd::AsRawFd,
};

use dataplane_common::{SO_ORIGINAL_DST, SOL_IP, SOL_IPV6};

/// The pre-REDIRECT destination of an accepted connection.
pub fn original_dst(stream: &impl AsRawFd, local: SocketAddr) -> io::Result<SocketAddr> {
    let mapped_v4 = match local {
        SocketAddr::V4(_) => true,
        SocketAddr::V6(v6) => v6.ip().to_ipv4_mapped().is_some(),
    };
    if mapped_v4 {
        // SAFETY: sockaddr_in is plain data; zero is a valid start.
        let mut addr: libc::sockaddr_in = unsafe { std::mem::zeroed() };
        getsockopt(stream, SOL_IP, &mut addr)?;
        let ip = Ipv4Addr::from(u32::from_be(addr.sin_addr.s_addr));
        Ok(SocketAddr::new(ip.into(), u16::from_be(addr.sin_port)))
    } else {
        // SAFETY: as above.
        let mut addr: libc::sockaddr_in6 = unsafe { std::mem::zeroed() };
        getsockopt(stream, SOL_IPV6, &mut addr)?;
        let ip = Ipv6Addr::from(addr.sin6_addr.s6_addr);
        Ok(SocketAddr::new(ip.into(), u16::from_be(addr.sin6_port)))
    }
}

fn getsockopt<T>(stream: &impl AsRawFd, level: i32, out: &mut T) -> io::Result<()> {
    let mut len = std::mem::size_of::<T>() as libc::socklen_t;
    // SAFETY: `out` is a valid, writable buffer of `len` bytes.
    let rc = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            level,
            SO_ORIGINAL_DST,
            (out as *mut T).cast(),
            &mut len,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}
