//! Reading what actually crosses a link: an `AF_PACKET` socket bound to an
//! interface inside a test's network namespace collects every frame while a
//! test runs, so a test can assert what appeared on the wire.

use std::{
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    thread::JoinHandle,
};

use crate::Netns;

/// A captured frame and whether it left through the interface.
type Frame = (Vec<u8>, bool);

/// A running capture; stop it with [`PacketCapture::finish`].
#[derive(Debug)]
pub struct PacketCapture {
    stop: Arc<AtomicBool>,
    frames: Arc<Mutex<Vec<Frame>>>,
    thread: Option<JoinHandle<()>>,
}

/// TCP segments seen, by port.
#[derive(Debug, Default, Clone)]
pub struct Captured {
    /// Every frame, raw.
    pub frames: Vec<Vec<u8>>,
    /// For each frame of `frames`: whether it left through the interface
    /// (`PACKET_OUTGOING`) rather than arrived.
    pub outgoing: Vec<bool>,
}

impl Captured {
    /// Whether `needle` appears anywhere in any frame.
    pub fn contains(&self, needle: &[u8]) -> bool {
        self.frames
            .iter()
            .any(|f| f.windows(needle.len()).any(|w| w == needle))
    }

    /// Frames that left through the interface with `src` as their IP
    /// source address.
    pub fn outgoing_from(&self, src: std::net::IpAddr) -> usize {
        self.frames
            .iter()
            .zip(&self.outgoing)
            .filter(|(f, out)| **out && ip_source(f) == Some(src))
            .count()
    }

    /// Frames carrying TCP with `port` as source or destination.
    pub fn tcp_frames_on_port(&self, port: u16) -> usize {
        self.frames
            .iter()
            .filter(|f| tcp_ports(f).is_some_and(|(s, d)| s == port || d == port))
            .count()
    }

    /// Frames carrying TCP on any port other than `port`.
    pub fn tcp_frames_not_on_port(&self, port: u16) -> usize {
        self.frames
            .iter()
            .filter(|f| tcp_ports(f).is_some_and(|(s, d)| s != port && d != port))
            .count()
    }
}

/// The IP source address of an Ethernet frame, if it carries IP.
fn ip_source(frame: &[u8]) -> Option<std::net::IpAddr> {
    let ethertype = u16::from_be_bytes([*frame.get(12)?, *frame.get(13)?]);
    match ethertype {
        0x0800 => {
            let b: [u8; 4] = frame.get(26..30)?.try_into().ok()?;
            Some(std::net::Ipv4Addr::from(b).into())
        }
        0x86dd => {
            let b: [u8; 16] = frame.get(22..38)?.try_into().ok()?;
            Some(std::net::Ipv6Addr::from(b).into())
        }
        _ => None,
    }
}

/// TCP source and destination ports of an Ethernet frame, if it carries TCP.
fn tcp_ports(frame: &[u8]) -> Option<(u16, u16)> {
    let ethertype = u16::from_be_bytes([*frame.get(12)?, *frame.get(13)?]);
    let (proto, l4) = match ethertype {
        0x0800 => {
            let ihl = usize::from(frame.get(14)? & 0x0f) * 4;
            (*frame.get(14 + 9)?, 14 + ihl)
        }
        0x86dd => (*frame.get(14 + 6)?, 14 + 40),
        _ => return None,
    };
    if proto != 6 {
        return None;
    }
    let port = |at: usize| Some(u16::from_be_bytes([*frame.get(at)?, *frame.get(at + 1)?]));
    Some((port(l4)?, port(l4 + 2)?))
}

impl PacketCapture {
    /// Starts capturing on `ifname` inside `netns`.
    pub fn start(netns: &Netns, ifname: &str) -> anyhow::Result<Self> {
        let ifname = std::ffi::CString::new(ifname)?;
        let socket = netns.run(move || -> std::io::Result<OwnedFd> {
            let proto = (libc::ETH_P_ALL as u16).to_be();
            // SAFETY: plain socket(2); ownership taken at once.
            let fd = unsafe {
                libc::socket(
                    libc::AF_PACKET,
                    libc::SOCK_RAW | libc::SOCK_CLOEXEC,
                    i32::from(proto),
                )
            };
            if fd < 0 {
                return Err(std::io::Error::last_os_error());
            }
            // SAFETY: fd is fresh and ours.
            let owned = unsafe { OwnedFd::from_raw_fd(fd) };
            // SAFETY: valid C string.
            let index = unsafe { libc::if_nametoindex(ifname.as_ptr()) };
            if index == 0 {
                return Err(std::io::Error::last_os_error());
            }
            // SAFETY: zeroed sockaddr_ll is valid; fields set below.
            let mut addr: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
            addr.sll_family = libc::AF_PACKET as u16;
            addr.sll_protocol = proto;
            addr.sll_ifindex = index as i32;
            // SAFETY: addr is a valid sockaddr_ll of the given size.
            let rc = unsafe {
                libc::bind(
                    owned.as_raw_fd(),
                    (&raw const addr).cast(),
                    std::mem::size_of::<libc::sockaddr_ll>() as u32,
                )
            };
            if rc != 0 {
                return Err(std::io::Error::last_os_error());
            }
            let timeout = libc::timeval {
                tv_sec: 0,
                tv_usec: 50_000,
            };
            // SAFETY: valid option value and size.
            unsafe {
                libc::setsockopt(
                    owned.as_raw_fd(),
                    libc::SOL_SOCKET,
                    libc::SO_RCVTIMEO,
                    (&raw const timeout).cast(),
                    std::mem::size_of::<libc::timeval>() as u32,
                )
            };
            Ok(owned)
        })??;
        let stop = Arc::new(AtomicBool::new(false));
        let frames = Arc::new(Mutex::new(Vec::new()));
        let (stop2, frames2) = (Arc::clone(&stop), Arc::clone(&frames));
        let thread = std::thread::spawn(move || {
            let mut buf = vec![0u8; 65_536];
            while !stop2.load(Ordering::Relaxed) {
                // SAFETY: zeroed sockaddr_ll is valid; the kernel fills it.
                let mut from: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
                let mut from_len = std::mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t;
                // SAFETY: buf and from are valid for their lengths.
                let n = unsafe {
                    libc::recvfrom(
                        socket.as_raw_fd(),
                        buf.as_mut_ptr().cast(),
                        buf.len(),
                        0,
                        (&raw mut from).cast(),
                        &raw mut from_len,
                    )
                };
                if n > 0
                    && let Ok(mut frames) = frames2.lock()
                {
                    let outgoing = from.sll_pkttype == libc::PACKET_OUTGOING;
                    frames.push((buf[..n as usize].to_vec(), outgoing));
                }
            }
        });
        Ok(Self {
            stop,
            frames,
            thread: Some(thread),
        })
    }

    /// Stops and returns everything captured.
    pub fn finish(mut self) -> Captured {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let (frames, outgoing) = self
            .frames
            .lock()
            .map(|f| f.iter().cloned().unzip())
            .unwrap_or_default();
        Captured { frames, outgoing }
    }
}

impl Drop for PacketCapture {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
