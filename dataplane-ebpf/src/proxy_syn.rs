//! `classifier` (tc) on ingress of `lo` inside the network namespace of a
//! pod served by an external in-pod proxy (Istio's ztunnel): makes the
//! proxy's transparent connections to the pod's apps work without
//! iptables (minimum kernel 4.x for tc classifiers writing `skb->mark`;
//! attached through netlink with a `clsact` qdisc, so 5.10 is fine).
//!
//! Such a proxy connects to the app from an `IP_TRANSPARENT` socket bound
//! to the client's address and carrying the proxy mark (0x539). Its SYN
//! goes to the pod's own address, so it crosses the pod's `lo`, where this
//! program sees it before the kernel looks for a socket. For a TCP SYN
//! (not a SYN-ACK) with the proxy mark, addressed to an enrolled pod IP
//! from a foreign address, it
//!
//! - records the tuple in `TPROXY_TUPLES`, so `sk_lookup` lets exactly this
//!   SYN reach the app instead of capturing it like the client's own (a
//!   retransmitted SYN is recorded again);
//! - replaces the mark with the transparent mark (0x53a): with the pod's
//!   `tcp_fwmark_accept` the app's accepted socket takes it, and the pod's
//!   `fwmark 0x53a -> local default dev lo` rule routes the app's replies,
//!   addressed to the client, back to the proxy instead of out of the pod.
//!
//! The proxy's other connections (out of the pod, also with the proxy mark)
//! never cross `lo` and are left alone, which an `ip rule` on the proxy
//! mark could not do. Every other packet passes untouched.

use aya_ebpf::{bindings::TC_ACT_UNSPEC, macros::classifier, programs::TcContext};
use dataplane_common::{Counter, IpAddr16, POD_CAPTURE_INBOUND, SockTuple};

use crate::maps::{POD_INBOUND, TPROXY_TUPLES, agent_config, count};

/// Ethernet header length: `lo` frames carry an all-zero one, and tc sees
/// ingress packets from their link-layer header.
const ETH_HLEN: usize = 14;
/// Offset of the EtherType in the Ethernet header.
const ETH_TYPE: usize = 12;
const ETH_P_IP: u16 = 0x0800;
const ETH_P_IPV6: u16 = 0x86dd;
const IPPROTO_TCP: u8 = 6;
/// IPv6 header length (the kernel's own SYNs carry no extension headers).
const IPV6_HLEN: usize = 40;
const TCP_FLAGS: usize = 13;
const TCP_SYN: u8 = 0x02;
const TCP_ACK: u8 = 0x10;
/// `frag_off` bits of a fragment that is not the first.
const IP_OFFSET_MASK: u16 = 0x1fff;

#[classifier]
pub fn dp_proxy_syn(ctx: TcContext) -> i32 {
    inspect(&ctx);
    // Go on with the next filter, if any, else deliver: never drop here.
    TC_ACT_UNSPEC
}

#[inline(always)]
fn inspect(ctx: &TcContext) {
    let Some(cfg) = agent_config() else {
        return;
    };
    if cfg.transparent_mark == 0 {
        return;
    }
    // SAFETY: a context field read, checked by the verifier.
    let mark = unsafe { (*ctx.skb.skb).mark };
    if mark != cfg.proxy_mark {
        return;
    }
    let Some(tuple) = syn_tuple(ctx) else {
        return;
    };
    if tuple.src_addr.is_loopback() {
        return;
    }
    match POD_INBOUND.get_ptr(tuple.dst_addr) {
        // SAFETY: a pointer from a successful lookup; one field is read.
        Some(pod) if unsafe { (*pod).flags } & POD_CAPTURE_INBOUND != 0 => {}
        _ => return,
    }
    if TPROXY_TUPLES.insert(tuple, 0, 0).is_err() {
        count(Counter::MapUpdateFailed);
    }
    ctx.set_mark(cfg.transparent_mark);
    count(Counter::ProxySynRemarked);
}

/// The tuple of a TCP SYN without ACK, IPv4 or IPv6; `None` for anything
/// else.
#[inline(always)]
fn syn_tuple(ctx: &TcContext) -> Option<SockTuple> {
    let ether_type = u16::from_be(ctx.load::<u16>(ETH_TYPE).ok()?);
    let (src_addr, dst_addr, l4) = if ether_type == ETH_P_IP {
        let version_ihl = ctx.load::<u8>(ETH_HLEN).ok()?;
        if version_ihl >> 4 != 4 {
            return None;
        }
        let frag_off = u16::from_be(ctx.load::<u16>(ETH_HLEN + 6).ok()?);
        if frag_off & IP_OFFSET_MASK != 0 || ctx.load::<u8>(ETH_HLEN + 9).ok()? != IPPROTO_TCP {
            return None;
        }
        // Loaded as stored: network-order bytes, as `from_ipv4_be` takes.
        let src = ctx.load::<u32>(ETH_HLEN + 12).ok()?;
        let dst = ctx.load::<u32>(ETH_HLEN + 16).ok()?;
        let ihl = usize::from(version_ihl & 0x0f) * 4;
        if ihl < 20 {
            return None;
        }
        (
            IpAddr16::from_ipv4_be(src),
            IpAddr16::from_ipv4_be(dst),
            ETH_HLEN + ihl,
        )
    } else if ether_type == ETH_P_IPV6 {
        if ctx.load::<u8>(ETH_HLEN + 6).ok()? != IPPROTO_TCP {
            return None;
        }
        let src = ctx.load::<[u32; 4]>(ETH_HLEN + 8).ok()?;
        let dst = ctx.load::<[u32; 4]>(ETH_HLEN + 24).ok()?;
        (
            IpAddr16::from_ipv6_words(src),
            IpAddr16::from_ipv6_words(dst),
            ETH_HLEN + IPV6_HLEN,
        )
    } else {
        return None;
    };
    let flags = ctx.load::<u8>(l4 + TCP_FLAGS).ok()?;
    if flags & (TCP_SYN | TCP_ACK) != TCP_SYN {
        return None;
    }
    let src_port = u16::from_be(ctx.load::<u16>(l4).ok()?);
    let dst_port = u16::from_be(ctx.load::<u16>(l4 + 2).ok()?);
    Some(SockTuple {
        src_addr,
        dst_addr,
        src_port,
        dst_port,
    })
}
