//! Library target of the kernel crate. It exists only so `dataplane-user` can
//! declare a build-dependency on this crate (which makes cargo rebuild the
//! embedded object when the kernel sources change); the programs live in the
//! `dataplane-ebpf` binary target.
#![no_std]
