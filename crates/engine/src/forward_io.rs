//! The `AsyncRead` and `AsyncWrite` methods of a stream wrapper that hands
//! each call to the stream it wraps, written once for every wrapper of the
//! engine (`hbone::linger::LingerOnClose`, and `ResetOnDrop` and
//! `RevocableClient` of `proxy::revocation`).
//!
//! A wrapper names the field holding its stream and, if a call may be
//! refused before it reaches the stream, a method
//! `fn name(&mut self, cx: &mut Context<'_>) -> io::Result<()>` run first,
//! whose error is returned instead:
//!
//! ```ignore
//! impl AsyncRead for Wrapper {
//!     forward_async_read!(inner, check = fail_if_revoked);
//! }
//! impl AsyncWrite for Wrapper {
//!     forward_async_write!(inner, check = fail_if_revoked);
//! }
//! ```
//!
//! `forward_async_write!(inner, except poll_shutdown)` leaves
//! `poll_shutdown` to the wrapper, which writes its own.

/// `poll_read`, handed to the wrapped stream (see the module documentation).
macro_rules! forward_async_read {
    ($inner:ident $(, check = $check:ident)?) => {
        fn poll_read(
            mut self: ::std::pin::Pin<&mut Self>,
            cx: &mut ::std::task::Context<'_>,
            buf: &mut ::tokio::io::ReadBuf<'_>,
        ) -> ::std::task::Poll<::std::io::Result<()>> {
            $(if let Err(e) = self.$check(cx) {
                return ::std::task::Poll::Ready(Err(e));
            })?
            ::tokio::io::AsyncRead::poll_read(::std::pin::Pin::new(&mut self.$inner), cx, buf)
        }
    };
}

/// `poll_write`, `poll_flush`, `poll_write_vectored`, `is_write_vectored`
/// and, unless excepted, `poll_shutdown`, handed to the wrapped stream (see
/// the module documentation).
macro_rules! forward_async_write {
    ($inner:ident, except poll_shutdown) => {
        $crate::forward_io::forward_async_write!(@writes $inner, []);
    };
    ($inner:ident $(, check = $check:ident)?) => {
        $crate::forward_io::forward_async_write!(@writes $inner, [$($check)?]);
        $crate::forward_io::forward_async_write!(@no_data $inner, [$($check)?], poll_shutdown);
    };
    (@writes $inner:ident, [$($check:ident)?]) => {
        fn poll_write(
            mut self: ::std::pin::Pin<&mut Self>,
            cx: &mut ::std::task::Context<'_>,
            buf: &[u8],
        ) -> ::std::task::Poll<::std::io::Result<usize>> {
            $(if let Err(e) = self.$check(cx) {
                return ::std::task::Poll::Ready(Err(e));
            })?
            ::tokio::io::AsyncWrite::poll_write(::std::pin::Pin::new(&mut self.$inner), cx, buf)
        }

        $crate::forward_io::forward_async_write!(@no_data $inner, [$($check)?], poll_flush);

        fn poll_write_vectored(
            mut self: ::std::pin::Pin<&mut Self>,
            cx: &mut ::std::task::Context<'_>,
            bufs: &[::std::io::IoSlice<'_>],
        ) -> ::std::task::Poll<::std::io::Result<usize>> {
            $(if let Err(e) = self.$check(cx) {
                return ::std::task::Poll::Ready(Err(e));
            })?
            ::tokio::io::AsyncWrite::poll_write_vectored(
                ::std::pin::Pin::new(&mut self.$inner),
                cx,
                bufs,
            )
        }

        fn is_write_vectored(&self) -> bool {
            ::tokio::io::AsyncWrite::is_write_vectored(&self.$inner)
        }
    };
    // `poll_flush` or `poll_shutdown`: the calls that carry no data.
    (@no_data $inner:ident, [$($check:ident)?], $method:ident) => {
        fn $method(
            mut self: ::std::pin::Pin<&mut Self>,
            cx: &mut ::std::task::Context<'_>,
        ) -> ::std::task::Poll<::std::io::Result<()>> {
            $(if let Err(e) = self.$check(cx) {
                return ::std::task::Poll::Ready(Err(e));
            })?
            ::tokio::io::AsyncWrite::$method(::std::pin::Pin::new(&mut self.$inner), cx)
        }
    };
}

pub(crate) use {forward_async_read, forward_async_write};
