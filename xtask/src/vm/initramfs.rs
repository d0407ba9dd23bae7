//! The guest's root filesystem: an uncompressed `newc` cpio archive the
//! kernel unpacks into its rootfs before running `/init`.
//!
//! Host binaries go in with the shared libraries `ldd` lists (at the same
//! paths, so the guest's loader finds them); the project's binaries lose
//! their debug info on the way (`strip --strip-debug`: 100 MB test binaries
//! become 10 MB), which leaves the embedded eBPF object intact.

use std::{
    collections::BTreeMap,
    fs::File,
    io::{self, BufWriter, Write},
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, Result, bail};

use crate::cmd;

/// What one path of the archive is.
#[derive(Debug, Clone)]
enum Node {
    Dir,
    /// A host file's contents, with the mode to give it.
    File {
        source: PathBuf,
        mode: u32,
    },
    /// Literal contents.
    Bytes {
        data: Vec<u8>,
        mode: u32,
    },
    Symlink(String),
}

/// An archive being assembled: guest paths (absolute, `/`-separated) to
/// what they hold. Parents are added as directories.
#[derive(Debug, Clone, Default)]
pub struct Tree {
    nodes: BTreeMap<String, Node>,
}

impl Tree {
    fn insert(&mut self, guest: &str, node: Node) {
        let guest = guest.trim_start_matches('/');
        let mut parent = String::new();
        for part in Path::new(guest)
            .parent()
            .into_iter()
            .flat_map(Path::components)
        {
            if !parent.is_empty() {
                parent.push('/');
            }
            parent.push_str(&part.as_os_str().to_string_lossy());
            self.nodes.entry(parent.clone()).or_insert(Node::Dir);
        }
        self.nodes.insert(guest.to_owned(), node);
    }

    /// An empty directory.
    pub fn dir(&mut self, guest: &str) {
        self.insert(guest, Node::Dir);
    }

    /// A symbolic link to `target`.
    pub fn symlink(&mut self, guest: &str, target: &str) {
        self.insert(guest, Node::Symlink(target.to_owned()));
    }

    /// A file with literal contents.
    pub fn bytes(&mut self, guest: &str, data: impl Into<Vec<u8>>, mode: u32) {
        self.insert(
            guest,
            Node::Bytes {
                data: data.into(),
                mode,
            },
        );
    }

    /// A copy of the host file `source`.
    pub fn file(&mut self, guest: &str, source: &Path, mode: u32) {
        self.insert(
            guest,
            Node::File {
                source: source.to_path_buf(),
                mode,
            },
        );
    }

    /// A host executable at `guest`, with the shared libraries it loads at
    /// their host paths.
    pub fn executable(&mut self, guest: &str, source: &Path) -> Result<()> {
        self.file(guest, source, 0o755);
        for library in shared_libraries(source)? {
            let guest_path = library.to_string_lossy().into_owned();
            // The loader opens the path ldd printed; give it the file's
            // contents there (even where the host has a symlink).
            let real = std::fs::canonicalize(&library)
                .with_context(|| format!("cannot resolve {}", library.display()))?;
            self.file(&guest_path, &real, 0o755);
        }
        Ok(())
    }

    /// Writes the archive to `path`.
    pub fn write(&self, path: &Path) -> Result<()> {
        let file =
            File::create(path).with_context(|| format!("cannot create {}", path.display()))?;
        let mut out = CpioWriter::new(BufWriter::with_capacity(1 << 20, file));
        for (name, node) in &self.nodes {
            match node {
                Node::Dir => out.entry(name, 0o040_755, &[])?,
                Node::Symlink(target) => out.entry(name, 0o120_777, target.as_bytes())?,
                Node::Bytes { data, mode } => out.entry(name, 0o100_000 | mode, data)?,
                Node::File { source, mode } => {
                    let data = std::fs::read(source)
                        .with_context(|| format!("cannot read {}", source.display()))?;
                    out.entry(name, 0o100_000 | mode, &data)?;
                }
            }
        }
        out.finish()?.flush()?;
        Ok(())
    }
}

/// `strip --strip-debug` of `source` into `dir`, named `name`.
pub fn stripped(source: &Path, dir: &Path, name: &str) -> Result<PathBuf> {
    let out = dir.join(name);
    cmd::output(
        Command::new("strip")
            .arg("--strip-debug")
            .arg("-o")
            .arg(&out)
            .arg(source),
    )
    .context("strip (binutils) is needed to pack the VM's binaries")?;
    Ok(out)
}

/// The shared libraries (and loader) `ldd` lists for `binary`; none for a
/// static one.
fn shared_libraries(binary: &Path) -> Result<Vec<PathBuf>> {
    let out = Command::new("ldd")
        .arg(binary)
        .output()
        .context("cannot run ldd")?;
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        // `not a dynamic executable`: a static binary.
        if String::from_utf8_lossy(&out.stderr).contains("not a dynamic executable")
            || text.contains("not a dynamic executable")
        {
            return Ok(Vec::new());
        }
        bail!(
            "ldd {} failed: {}",
            binary.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(parse_ldd(&text))
}

/// Reads `ldd` output: `libc.so.6 => /lib/.../libc.so.6 (0x...)` and
/// `/lib64/ld-linux-x86-64.so.2 (0x...)` lines.
fn parse_ldd(text: &str) -> Vec<PathBuf> {
    text.lines()
        .filter_map(|line| {
            let path = match line.split_once("=>") {
                Some((_, right)) => right.split_whitespace().next()?,
                None => line.split_whitespace().next()?,
            };
            path.starts_with('/').then(|| PathBuf::from(path))
        })
        .collect()
}

/// Writes the `newc` (SVR4, no CRC) cpio format.
struct CpioWriter<W: Write> {
    out: W,
    inode: u32,
}

impl<W: Write> CpioWriter<W> {
    fn new(out: W) -> Self {
        Self { out, inode: 1 }
    }

    fn entry(&mut self, name: &str, mode: u32, data: &[u8]) -> io::Result<()> {
        let size = u32::try_from(data.len()).map_err(|_| io::Error::other("file over 4 GiB"))?;
        self.header(name, mode, size)?;
        self.out.write_all(data)?;
        self.pad(data.len())?;
        self.inode += 1;
        Ok(())
    }

    fn header(&mut self, name: &str, mode: u32, size: u32) -> io::Result<()> {
        let name_size = u32::try_from(name.len() + 1).map_err(|_| io::Error::other("name"))?;
        // magic, ino, mode, uid, gid, nlink, mtime, filesize, devmajor,
        // devminor, rdevmajor, rdevminor, namesize, check
        let nlink = if mode & 0o170_000 == 0o040_000 { 2 } else { 1 };
        let fields = [
            self.inode, mode, 0, 0, nlink, 0, size, 0, 0, 0, 0, name_size, 0,
        ];
        let mut header = String::from("070701");
        for field in fields {
            header.push_str(&format!("{field:08x}"));
        }
        self.out.write_all(header.as_bytes())?;
        self.out.write_all(name.as_bytes())?;
        self.out.write_all(&[0])?;
        self.pad(header.len() + name.len() + 1)
    }

    /// Pads to the next multiple of four after `len` bytes.
    fn pad(&mut self, len: usize) -> io::Result<()> {
        let padding = (4 - len % 4) % 4;
        self.out.write_all(&[0u8; 3][..padding])
    }

    fn finish(mut self) -> io::Result<W> {
        self.header("TRAILER!!!", 0, 0)?;
        Ok(self.out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_ldd_output() {
        let text = "\tlinux-vdso.so.1 (0x00007ffd)\n\
                    \tlibc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x00007f)\n\
                    \t/lib64/ld-linux-x86-64.so.2 (0x00007f)\n";
        assert_eq!(
            parse_ldd(text),
            [
                PathBuf::from("/lib/x86_64-linux-gnu/libc.so.6"),
                PathBuf::from("/lib64/ld-linux-x86-64.so.2")
            ]
        );
    }

    #[test]
    fn cpio_entries_are_aligned_and_terminated() {
        let mut out = CpioWriter::new(Vec::new());
        out.entry("init", 0o100_755, b"#!/bin/sh\n").expect("entry");
        let bytes = out.finish().expect("finish");
        assert!(bytes.starts_with(b"070701"));
        assert_eq!(bytes.len() % 4, 0);
        let text = String::from_utf8_lossy(&bytes);
        assert!(text.contains("init\0"));
        assert!(text.contains("TRAILER!!!\0"));
        // The file's size field (the 8th) is 10 bytes.
        assert_eq!(&text[6 + 6 * 8..6 + 7 * 8], "0000000a");
    }

    #[test]
    fn parents_become_directories() {
        let mut tree = Tree::default();
        tree.bytes("/a/b/c", "x", 0o644);
        let names: Vec<_> = tree.nodes.keys().cloned().collect();
        assert_eq!(names, ["a", "a/b", "a/b/c"]);
    }
}
