//! Socket options socket2 does not cover, read with `getsockopt(2)`.

use std::{
    io,
    os::fd::{AsRawFd as _, BorrowedFd},
};

/// A `SOL_SOCKET` option whose value is a `u64` (`SO_COOKIE`,
/// `SO_NETNS_COOKIE`), which socket2 does not cover.
pub(crate) fn sol_socket_u64(socket: BorrowedFd<'_>, option: libc::c_int) -> io::Result<u64> {
    let mut value: u64 = 0;
    let mut len = std::mem::size_of::<u64>() as libc::socklen_t;
    // SAFETY: valid fd, and a buffer of the size the kernel writes.
    let rc = unsafe {
        libc::getsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            option,
            (&raw mut value).cast(),
            &mut len,
        )
    };
    if rc == 0 {
        Ok(value)
    } else {
        Err(io::Error::last_os_error())
    }
}
