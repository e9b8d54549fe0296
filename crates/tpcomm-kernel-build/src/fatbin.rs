//! Reading a fatbin back: which code it carries for which architecture, the kernel entry
//! points of each, and the initial bytes of a device global.
//!
//! Format (little endian, as nvcc writes it; not documented by NVIDIA, these are the
//! fields this parser relies on):
//!
//! ```text
//! container header, 16 bytes:  u32 magic 0xBA55ED50 | u16 version | u16 header size
//!                              | u64 size of the entries that follow
//! entry header (>= 64 bytes):  u16 kind (1 PTX, 2 ELF cubin) | u16 | u32 header size
//!                              | u64 payload size | u32 | u32 | u16 minor | u16 major
//!                              | u32 arch (80 = sm_80) | u32 | u32 | u64 flags | ...
//! payload:                     follows the entry header; PTX is NUL-padded text
//! ```
//!
//! Flag `0x2000` marks a compressed payload. This parser refuses those (the build asks
//! nvcc for `--compress-mode=none`) rather than guessing a decompressor.

use std::fmt;

use crate::elf::Elf;

/// First word of every fatbin container.
pub const FATBIN_MAGIC: u32 = 0xBA55_ED50;
/// Entry flag: the payload is compressed.
pub const FLAG_COMPRESSED: u64 = 0x2000;

/// What a fatbin entry holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EntryKind {
    /// PTX text for `compute_<arch>`.
    Ptx,
    /// An ELF cubin with SASS for `sm_<arch>`.
    Cubin,
}

/// Why a fatbin could not be read.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum FatbinError {
    /// The bytes at `offset` are not a fatbin container header.
    BadMagic {
        /// Byte offset of the container.
        offset: usize,
        /// The word found there.
        found: u32,
    },
    /// A header or payload extends past the end of the data.
    Truncated {
        /// Byte offset of the header or payload.
        offset: usize,
        /// What was being read.
        what: &'static str,
    },
    /// An entry kind other than PTX (1) or ELF (2).
    UnknownKind {
        /// Byte offset of the entry header.
        offset: usize,
        /// The kind found.
        kind: u16,
    },
    /// A compressed entry; rebuild with `--compress-mode=none`.
    Compressed {
        /// The entry's kind.
        kind: EntryKind,
        /// The entry's architecture.
        arch: u32,
    },
    /// A cubin that is not a readable ELF image.
    BadCubin {
        /// The cubin's architecture.
        arch: u32,
        /// What is wrong.
        detail: String,
    },
    /// PTX text that is not UTF-8 or whose global could not be read.
    BadPtx {
        /// The PTX's architecture.
        arch: u32,
        /// What is wrong.
        detail: String,
    },
}

impl fmt::Display for FatbinError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FatbinError::BadMagic { offset, found } => write!(
                f,
                "no fatbin container at byte {offset}: magic {found:#010x}, expected {FATBIN_MAGIC:#010x}"
            ),
            FatbinError::Truncated { offset, what } => {
                write!(f, "fatbin truncated: {what} at byte {offset} runs past the end")
            }
            FatbinError::UnknownKind { offset, kind } => {
                write!(f, "fatbin entry at byte {offset} has unknown kind {kind}")
            }
            FatbinError::Compressed { kind, arch } => write!(
                f,
                "fatbin entry {kind:?} for arch {arch} is compressed; build with --compress-mode=none"
            ),
            FatbinError::BadCubin { arch, detail } => write!(f, "cubin for sm_{arch}: {detail}"),
            FatbinError::BadPtx { arch, detail } => write!(f, "PTX for compute_{arch}: {detail}"),
        }
    }
}

impl std::error::Error for FatbinError {}

/// One entry of a fatbin.
#[derive(Debug, Clone, Copy)]
pub struct FatbinEntry<'a> {
    /// PTX or cubin.
    pub kind: EntryKind,
    /// Compute capability as a number (80 for sm_80 / compute_80).
    pub arch: u32,
    /// The entry's flags word.
    pub flags: u64,
    /// The payload (ELF image, or PTX text possibly followed by NUL padding).
    pub payload: &'a [u8],
}

impl<'a> FatbinEntry<'a> {
    /// `sm_80` for a cubin, `compute_80` for PTX.
    pub fn target_name(&self) -> String {
        match self.kind {
            EntryKind::Cubin => format!("sm_{}", self.arch),
            EntryKind::Ptx => format!("compute_{}", self.arch),
        }
    }

    /// PTX text without its NUL padding.
    ///
    /// # Errors
    /// [`FatbinError::BadPtx`] for a cubin entry or non-UTF-8 text.
    pub fn ptx_text(&self) -> Result<&'a str, FatbinError> {
        if self.kind != EntryKind::Ptx {
            return Err(FatbinError::BadPtx {
                arch: self.arch,
                detail: "entry is a cubin, not PTX".into(),
            });
        }
        let end = self
            .payload
            .iter()
            .position(|&b| b == 0)
            .unwrap_or(self.payload.len());
        std::str::from_utf8(&self.payload[..end]).map_err(|e| FatbinError::BadPtx {
            arch: self.arch,
            detail: e.to_string(),
        })
    }

    /// Kernel entry points: symbols marked as CUDA entries in a cubin, `.entry`
    /// directives in PTX.
    ///
    /// # Errors
    /// [`FatbinError::BadCubin`] / [`FatbinError::BadPtx`] when the payload is unreadable.
    pub fn entry_points(&self) -> Result<Vec<String>, FatbinError> {
        match self.kind {
            EntryKind::Cubin => Ok(self.elf()?.entry_points()),
            EntryKind::Ptx => Ok(ptx_entry_points(self.ptx_text()?)),
        }
    }

    /// The initial bytes of the device global `name` (an initialized `__device__`
    /// variable), `None` when the entry has no such global.
    ///
    /// # Errors
    /// [`FatbinError::BadCubin`] / [`FatbinError::BadPtx`] when the payload or the
    /// global's definition is unreadable.
    pub fn global_bytes(&self, name: &str) -> Result<Option<Vec<u8>>, FatbinError> {
        match self.kind {
            EntryKind::Cubin => {
                self.elf()?
                    .object_bytes(name)
                    .map_err(|detail| FatbinError::BadCubin {
                        arch: self.arch,
                        detail,
                    })
            }
            EntryKind::Ptx => {
                ptx_global_bytes(self.ptx_text()?, name).map_err(|detail| FatbinError::BadPtx {
                    arch: self.arch,
                    detail,
                })
            }
        }
    }

    fn elf(&self) -> Result<Elf<'a>, FatbinError> {
        if self.kind != EntryKind::Cubin {
            return Err(FatbinError::BadCubin {
                arch: self.arch,
                detail: "entry is PTX, not a cubin".into(),
            });
        }
        Elf::parse(self.payload).map_err(|detail| FatbinError::BadCubin {
            arch: self.arch,
            detail,
        })
    }
}

/// A parsed fatbin (one or more containers back to back).
#[derive(Debug, Clone)]
pub struct Fatbin<'a> {
    entries: Vec<FatbinEntry<'a>>,
}

fn read<const N: usize>(
    bytes: &[u8],
    at: usize,
    what: &'static str,
) -> Result<[u8; N], FatbinError> {
    at.checked_add(N)
        .and_then(|end| bytes.get(at..end))
        .and_then(|s| s.try_into().ok())
        .ok_or(FatbinError::Truncated { offset: at, what })
}

impl<'a> Fatbin<'a> {
    /// Parses every container and entry.
    ///
    /// # Errors
    /// A [`FatbinError`] for a bad magic, truncated data, an unknown entry kind or a
    /// compressed entry. Never panics on malformed input.
    pub fn parse(bytes: &'a [u8]) -> Result<Fatbin<'a>, FatbinError> {
        let mut entries = Vec::new();
        let mut at = 0usize;
        while at < bytes.len() {
            // Zero padding may follow the last container.
            if !entries.is_empty() && bytes[at..].iter().all(|&b| b == 0) {
                break;
            }
            let magic = u32::from_le_bytes(read(bytes, at, "container header")?);
            if magic != FATBIN_MAGIC {
                return Err(FatbinError::BadMagic {
                    offset: at,
                    found: magic,
                });
            }
            let header_size =
                usize::from(u16::from_le_bytes(read(bytes, at + 6, "container header")?));
            let body = u64::from_le_bytes(read(bytes, at + 8, "container header")?);
            let start = at.checked_add(header_size).ok_or(FatbinError::Truncated {
                offset: at,
                what: "container",
            })?;
            let end = usize::try_from(body)
                .ok()
                .and_then(|b| start.checked_add(b))
                .filter(|&e| e <= bytes.len())
                .ok_or(FatbinError::Truncated {
                    offset: at,
                    what: "container",
                })?;
            let mut e = start;
            while e < end {
                let kind_raw = u16::from_le_bytes(read(bytes, e, "entry header")?);
                let entry_header = u32::from_le_bytes(read(bytes, e + 4, "entry header")?);
                let payload_size = u64::from_le_bytes(read(bytes, e + 8, "entry header")?);
                let arch = u32::from_le_bytes(read(bytes, e + 28, "entry header")?);
                let flags = u64::from_le_bytes(read(bytes, e + 40, "entry header")?);
                let kind = match kind_raw {
                    1 => EntryKind::Ptx,
                    2 => EntryKind::Cubin,
                    kind => return Err(FatbinError::UnknownKind { offset: e, kind }),
                };
                if flags & FLAG_COMPRESSED != 0 {
                    return Err(FatbinError::Compressed { kind, arch });
                }
                let payload_start = usize::try_from(entry_header)
                    .ok()
                    .and_then(|h| e.checked_add(h))
                    .ok_or(FatbinError::Truncated {
                        offset: e,
                        what: "entry",
                    })?;
                let payload_end = usize::try_from(payload_size)
                    .ok()
                    .and_then(|p| payload_start.checked_add(p))
                    .filter(|&p| p <= end && entry_header >= 48)
                    .ok_or(FatbinError::Truncated {
                        offset: e,
                        what: "entry payload",
                    })?;
                entries.push(FatbinEntry {
                    kind,
                    arch,
                    flags,
                    payload: &bytes[payload_start..payload_end],
                });
                e = payload_end;
            }
            at = end;
        }
        Ok(Fatbin { entries })
    }

    /// Every entry, in file order.
    pub fn entries(&self) -> &[FatbinEntry<'a>] {
        &self.entries
    }

    /// The cubin for `sm_<arch>`, if any.
    pub fn cubin(&self, arch: u32) -> Option<&FatbinEntry<'a>> {
        self.entries
            .iter()
            .find(|e| e.kind == EntryKind::Cubin && e.arch == arch)
    }

    /// The PTX for `compute_<arch>`, if any.
    pub fn ptx(&self, arch: u32) -> Option<&FatbinEntry<'a>> {
        self.entries
            .iter()
            .find(|e| e.kind == EntryKind::Ptx && e.arch == arch)
    }
}

/// Names declared with `.entry` in PTX text.
pub fn ptx_entry_points(ptx: &str) -> Vec<String> {
    let mut names = Vec::new();
    for line in ptx.lines() {
        let mut words = line.split_whitespace();
        while let Some(w) = words.next() {
            if w == ".entry" {
                if let Some(next) = words.next() {
                    let name = next.split('(').next().unwrap_or(next);
                    if !name.is_empty() {
                        names.push(name.to_owned());
                    }
                }
                break;
            }
        }
    }
    names
}

/// Initial bytes of `.global ... .b8|.u8|.b16|... NAME[N] = {...};` in PTX text
/// (elements not listed are zero), `None` when no such global is defined.
pub fn ptx_global_bytes(ptx: &str, name: &str) -> Result<Option<Vec<u8>>, String> {
    let decl = format!(" {name}[");
    let Some(line) = ptx
        .lines()
        .map(str::trim)
        .find(|l| l.contains(".global") && l.contains(&decl))
    else {
        return Ok(None);
    };
    let width = [
        (".b8 ", 1usize),
        (".u8 ", 1),
        (".b16 ", 2),
        (".u16 ", 2),
        (".b32 ", 4),
        (".u32 ", 4),
        (".b64 ", 8),
        (".u64 ", 8),
    ]
    .iter()
    .find(|(t, _)| line.contains(t))
    .map(|&(_, w)| w)
    .ok_or_else(|| format!("`{name}`: unsupported element type in `{line}`"))?;
    let after = &line[line.find(&decl).map(|i| i + decl.len()).unwrap_or(0)..];
    let count: usize = after
        .split(']')
        .next()
        .and_then(|n| n.trim().parse().ok())
        .ok_or_else(|| format!("`{name}`: no element count in `{line}`"))?;
    let mut out = vec![0u8; count * width];
    if let Some(open) = after.find('{') {
        let close = after[open..]
            .find('}')
            .ok_or_else(|| format!("`{name}`: initializer not closed on one line"))?;
        let values = &after[open + 1..open + close];
        for (i, v) in values
            .split(',')
            .map(str::trim)
            .filter(|v| !v.is_empty())
            .enumerate()
        {
            if i >= count {
                return Err(format!("`{name}`: more initializers than elements"));
            }
            let parsed = if let Some(hex) = v.strip_prefix("0x").or_else(|| v.strip_prefix("0X")) {
                u64::from_str_radix(hex, 16)
            } else {
                v.parse::<u64>()
            }
            .map_err(|e| format!("`{name}`: bad initializer `{v}`: {e}"))?;
            out[i * width..(i + 1) * width].copy_from_slice(&parsed.to_le_bytes()[..width]);
        }
    }
    Ok(Some(out))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(kind: u16, arch: u32, flags: u64, payload: &[u8]) -> Vec<u8> {
        let mut h = vec![0u8; 64];
        h[0..2].copy_from_slice(&kind.to_le_bytes());
        h[2..4].copy_from_slice(&0x0101u16.to_le_bytes());
        h[4..8].copy_from_slice(&64u32.to_le_bytes());
        h[8..16].copy_from_slice(&(payload.len() as u64).to_le_bytes());
        h[28..32].copy_from_slice(&arch.to_le_bytes());
        h[40..48].copy_from_slice(&flags.to_le_bytes());
        h.extend_from_slice(payload);
        h
    }

    fn container(entries: &[Vec<u8>]) -> Vec<u8> {
        let body: Vec<u8> = entries.concat();
        let mut c = Vec::new();
        c.extend_from_slice(&FATBIN_MAGIC.to_le_bytes());
        c.extend_from_slice(&1u16.to_le_bytes());
        c.extend_from_slice(&16u16.to_le_bytes());
        c.extend_from_slice(&(body.len() as u64).to_le_bytes());
        c.extend_from_slice(&body);
        c
    }

    const PTX: &str = "\
.version 9.0
.target sm_80
.address_size 64
.global .align 8 .b8 tpcomm_ar_layout[16] = {1, 0, 0, 0, 0, 0, 0, 0, 52, 18};
.visible .entry tpcomm_ar_1stage_f32_w2(
.entry plain_entry (
";

    #[test]
    fn ptx_entries_and_globals_are_read_from_a_synthetic_fatbin() {
        let mut ptx = PTX.as_bytes().to_vec();
        ptx.extend_from_slice(&[0; 7]);
        let bytes = container(&[entry(1, 80, 0x11, &ptx)]);
        let fb = Fatbin::parse(&bytes).unwrap();
        assert_eq!(fb.entries().len(), 1);
        let p = fb.ptx(80).unwrap();
        assert_eq!(p.target_name(), "compute_80");
        assert!(fb.cubin(80).is_none());
        assert_eq!(
            p.entry_points().unwrap(),
            ["tpcomm_ar_1stage_f32_w2", "plain_entry"]
        );
        let layout = p.global_bytes("tpcomm_ar_layout").unwrap().unwrap();
        let words: Vec<u64> = layout
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(words, [1, 0x1234]);
        assert_eq!(p.global_bytes("missing").unwrap(), None);
    }

    #[test]
    fn compressed_entries_are_refused_with_the_flag_to_use() {
        let bytes = container(&[entry(2, 90, 0x11 | FLAG_COMPRESSED, b"\x7fELF")]);
        let err = Fatbin::parse(&bytes).unwrap_err();
        assert_eq!(
            err,
            FatbinError::Compressed {
                kind: EntryKind::Cubin,
                arch: 90
            }
        );
        assert!(err.to_string().contains("--compress-mode=none"));
    }

    #[test]
    fn malformed_input_is_an_error_not_a_panic() {
        assert!(matches!(
            Fatbin::parse(b"\x00\x01\x02\x03rest"),
            Err(FatbinError::BadMagic { .. })
        ));
        let good = container(&[entry(2, 80, 0, b"payload")]);
        for cut in 1..good.len() {
            assert!(Fatbin::parse(&good[..cut]).is_err(), "cut at {cut}");
        }
        let unknown = container(&[entry(7, 80, 0, b"x")]);
        assert!(matches!(
            Fatbin::parse(&unknown),
            Err(FatbinError::UnknownKind { kind: 7, .. })
        ));
        // A cubin entry with garbage instead of ELF parses as an entry, fails as a cubin.
        let fb = Fatbin::parse(&good).unwrap();
        assert!(matches!(
            fb.cubin(80).unwrap().entry_points(),
            Err(FatbinError::BadCubin { arch: 80, .. })
        ));
    }

    #[test]
    fn trailing_zero_padding_after_a_container_is_accepted() {
        let mut bytes = container(&[entry(1, 80, 0, b".entry k(\n")]);
        bytes.extend_from_slice(&[0; 16]);
        assert_eq!(Fatbin::parse(&bytes).unwrap().entries().len(), 1);
    }

    #[test]
    fn ptx_global_of_wider_elements_is_little_endian() {
        let ptx = ".global .align 8 .u64 g[2] = {0x10, 3};";
        assert_eq!(
            ptx_global_bytes(ptx, "g").unwrap().unwrap(),
            [0x10, 0, 0, 0, 0, 0, 0, 0, 3, 0, 0, 0, 0, 0, 0, 0]
        );
    }
}
