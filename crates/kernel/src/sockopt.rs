//! Socket options socket2 does not cover, read with `getsockopt(2)`.

use std::{
    io,
    os::fd::{AsRawFd as _, BorrowedFd},
};

/// A `SOL_SOCKET` option whose value is a `u64` (`SO_COOKIE`,
/// `SO_NETNS_COOKIE`), which socket2 does not cover.
pub(crate) fn sol_socket_u64(socket: BorrowedFd<'_>, option: libc::c_int) -> io::Result<u64> {
    read(socket, libc::SOL_SOCKET, option)
}

/// An option whose value is a C `int` (`SO_PROTOCOL`, `SO_ACCEPTCONN`,
/// `IPV6_V6ONLY`, ...) on a socket the agent did not make.
pub(crate) fn int(
    socket: BorrowedFd<'_>,
    level: libc::c_int,
    option: libc::c_int,
) -> io::Result<libc::c_int> {
    read(socket, level, option)
}

/// Option `option` at `level`, of a plain integer type `T`.
fn read<T: Copy + Default>(
    socket: BorrowedFd<'_>,
    level: libc::c_int,
    option: libc::c_int,
) -> io::Result<T> {
    let mut value = T::default();
    let mut len = std::mem::size_of::<T>() as libc::socklen_t;
    // SAFETY: valid fd, and a buffer of the size the kernel may write
    // (`T` is a plain integer: every bit pattern is a value).
    let rc = unsafe {
        libc::getsockopt(
            socket.as_raw_fd(),
            level,
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
