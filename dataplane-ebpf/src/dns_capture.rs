//! The DNS capture decision shared by `connect4`/`connect6` (connected UDP
//! and TCP sockets) and `sendmsg4`/`sendmsg6` (unconnected UDP sends):
//! which query to port 53 of an enrolled pod goes to the pod's own
//! resolver at `127.0.0.1`/`[::1]:<dns port>`, the way Istio's node proxy
//! captures DNS (it, too, leaves loopback servers and its own sockets
//! alone).
//!
//! The server the application asked is recorded in `DNS_ORIG_COOKIE` under
//! the socket's cookie, so `recvmsg` and `getpeername` can show it again:
//! resolvers such as glibc's drop replies from an address they did not ask.

use aya_ebpf::{
    helpers::{bpf_get_netns_cookie, bpf_get_socket_cookie},
    programs::SockAddrContext,
};
use dataplane_common::{
    AGENT_FAIL_OPEN, Counter, DNS_PORT, DnsOrigDst, ENROLLED_CAPTURE_DNS, ENROLLED_ENGINE_READY,
    IpAddr16,
};

use crate::maps::{DNS_ORIG_COOKIE, ENROLLED_NETNS, agent_config, count};

const SOCK_STREAM: u32 = 1;
const SOCK_DGRAM: u32 = 2;
const IPPROTO_TCP: u32 = 6;
const IPPROTO_UDP: u32 = 17;

/// The resolver port to steer this DNS query to, or `None` to leave it
/// alone (not DNS, not captured, or no record could be kept). `dst:port`
/// is the destination the application gave (`port` in host order), and
/// `family` the socket's family (`AF_INET` or `AF_INET6`).
#[inline(always)]
pub fn steer(ctx: &SockAddrContext, dst: IpAddr16, port: u16, family: u16) -> Option<u16> {
    if port != DNS_PORT {
        return None;
    }
    let cfg = agent_config()?;
    if cfg.dns_port == 0 {
        return None;
    }
    let sa = ctx.sock_addr;
    // SAFETY: context field reads, checked by the verifier.
    let (sock_type, protocol) = unsafe { ((*sa).type_, (*sa).protocol) };
    let udp = sock_type == SOCK_DGRAM && protocol == IPPROTO_UDP;
    let tcp = sock_type == SOCK_STREAM && protocol == IPPROTO_TCP;
    if !udp && !tcp {
        return None;
    }
    // SAFETY: helper valid for sock_addr programs since 5.7.
    let netns = unsafe { bpf_get_netns_cookie(sa.cast()) };
    // SAFETY: a pointer from a successful lookup; the value is copied.
    let flags = unsafe { (*ENROLLED_NETNS.get_ptr(netns)?).flags };
    if flags & ENROLLED_CAPTURE_DNS == 0 {
        count(Counter::DnsPassed);
        return None;
    }
    // SAFETY: `sk` of a sock_addr context is a non-null full socket.
    let mark = unsafe { (*(*sa).__bindgen_anon_1.sk).mark };
    // The agent's own upstream queries carry the proxy mark.
    if (cfg.proxy_mark != 0 && mark == cfg.proxy_mark)
        || (cfg.transparent_mark != 0 && mark == cfg.transparent_mark)
        || dst.is_loopback()
    {
        count(Counter::DnsPassed);
        return None;
    }
    if flags & ENROLLED_ENGINE_READY == 0 && cfg.flags & AGENT_FAIL_OPEN != 0 {
        count(Counter::EngineDownPassed);
        return None;
    }
    let orig = DnsOrigDst {
        addr: dst,
        port,
        family,
        _pad: [0; 4],
    };
    // SAFETY: helper valid for sock_addr programs since 4.20.
    let cookie = unsafe { bpf_get_socket_cookie(sa.cast()) };
    if DNS_ORIG_COOKIE.insert(cookie, orig, 0).is_err() {
        // Without the record the reply would not match the server asked:
        // leave the query uncaptured rather than break it.
        count(Counter::MapUpdateFailed);
        return None;
    }
    count(Counter::DnsRedirected);
    Some(cfg.dns_port)
}

/// The server recorded for this socket, if the address it talks to
/// (`port`, host order) is the resolver's port.
#[inline(always)]
pub fn recorded_server(ctx: &SockAddrContext, port: u16) -> Option<DnsOrigDst> {
    let cfg = agent_config()?;
    if cfg.dns_port == 0 || port != cfg.dns_port {
        return None;
    }
    // SAFETY: helper valid for sock_addr programs since 4.20.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.sock_addr.cast()) };
    let orig = DNS_ORIG_COOKIE.get_ptr(cookie)?;
    // SAFETY: a pointer from a successful lookup; the value is copied.
    Some(unsafe { *orig })
}
