//! Just enough ELF64 (little endian) to read a cubin's symbol table and the bytes of a
//! symbol: kernel entry points and initialized device globals.

/// `st_other` bit ptxas sets on kernel entry functions (`STO_CUDA_ENTRY`).
const STO_CUDA_ENTRY: u8 = 0x10;
const SHT_SYMTAB: u32 = 2;
const SHT_NOBITS: u32 = 8;
const STT_OBJECT: u8 = 1;
const STT_FUNC: u8 = 2;

#[derive(Debug, Clone, Copy)]
struct Section {
    kind: u32,
    addr: u64,
    offset: u64,
    size: u64,
    link: u32,
    entsize: u64,
}

#[derive(Debug, Clone)]
pub(crate) struct Symbol {
    pub(crate) name: String,
    kind: u8,
    other: u8,
    section: u16,
    value: u64,
    size: u64,
}

impl Symbol {
    pub(crate) fn is_entry(&self) -> bool {
        self.kind == STT_FUNC && self.other & STO_CUDA_ENTRY != 0
    }
}

/// A parsed cubin: section headers and the symbol table.
#[derive(Debug)]
pub(crate) struct Elf<'a> {
    bytes: &'a [u8],
    sections: Vec<Section>,
    symbols: Vec<Symbol>,
}

fn slice(bytes: &[u8], offset: u64, len: u64) -> Result<&[u8], String> {
    let start = usize::try_from(offset).map_err(|_| format!("offset {offset} too large"))?;
    let len = usize::try_from(len).map_err(|_| format!("length {len} too large"))?;
    let end = start
        .checked_add(len)
        .ok_or_else(|| format!("range {start}+{len} overflows"))?;
    bytes.get(start..end).ok_or_else(|| {
        format!(
            "range {start}..{end} outside the {}-byte image",
            bytes.len()
        )
    })
}

fn u16_at(b: &[u8], at: usize) -> Result<u16, String> {
    Ok(u16::from_le_bytes(
        slice(b, at as u64, 2)?.try_into().map_err(|_| "u16")?,
    ))
}
fn u32_at(b: &[u8], at: usize) -> Result<u32, String> {
    Ok(u32::from_le_bytes(
        slice(b, at as u64, 4)?.try_into().map_err(|_| "u32")?,
    ))
}
fn u64_at(b: &[u8], at: usize) -> Result<u64, String> {
    Ok(u64::from_le_bytes(
        slice(b, at as u64, 8)?.try_into().map_err(|_| "u64")?,
    ))
}

fn c_string(table: &[u8], at: u32) -> Result<String, String> {
    let rest = table
        .get(at as usize..)
        .ok_or_else(|| format!("string offset {at} outside its table"))?;
    let end = rest
        .iter()
        .position(|&b| b == 0)
        .ok_or("unterminated string")?;
    Ok(String::from_utf8_lossy(&rest[..end]).into_owned())
}

impl<'a> Elf<'a> {
    pub(crate) fn parse(bytes: &'a [u8]) -> Result<Elf<'a>, String> {
        if bytes.get(..4) != Some(b"\x7fELF".as_slice()) {
            return Err("not an ELF image".into());
        }
        if bytes.get(4) != Some(&2) || bytes.get(5) != Some(&1) {
            return Err("not a 64-bit little-endian ELF image".into());
        }
        let shoff = u64_at(bytes, 0x28)?;
        let shentsize = u64::from(u16_at(bytes, 0x3a)?);
        let shnum = u64::from(u16_at(bytes, 0x3c)?);
        if shentsize < 64 {
            return Err(format!("section header size {shentsize} < 64"));
        }
        let mut sections = Vec::new();
        for i in 0..shnum {
            let h = slice(bytes, shoff + i * shentsize, 64)?;
            sections.push(Section {
                kind: u32_at(h, 4)?,
                addr: u64_at(h, 16)?,
                offset: u64_at(h, 24)?,
                size: u64_at(h, 32)?,
                link: u32_at(h, 40)?,
                entsize: u64_at(h, 56)?,
            });
        }
        let mut symbols = Vec::new();
        for s in sections.iter().filter(|s| s.kind == SHT_SYMTAB) {
            let strtab = sections
                .get(s.link as usize)
                .ok_or("symbol table links to a missing string table")?;
            let names = slice(bytes, strtab.offset, strtab.size)?;
            let table = slice(bytes, s.offset, s.size)?;
            let entsize = if s.entsize == 0 { 24 } else { s.entsize };
            if entsize < 24 {
                return Err(format!("symbol size {entsize} < 24"));
            }
            for chunk in table.chunks_exact(entsize as usize) {
                let info = chunk[4];
                symbols.push(Symbol {
                    name: c_string(names, u32_at(chunk, 0)?)?,
                    kind: info & 0xf,
                    other: chunk[5],
                    section: u16_at(chunk, 6)?,
                    value: u64_at(chunk, 8)?,
                    size: u64_at(chunk, 16)?,
                });
            }
        }
        Ok(Elf {
            bytes,
            sections,
            symbols,
        })
    }

    /// Kernel entry points, in symbol-table order.
    pub(crate) fn entry_points(&self) -> Vec<String> {
        self.symbols
            .iter()
            .filter(|s| s.is_entry())
            .map(|s| s.name.clone())
            .collect()
    }

    /// The initial bytes of the data object `name`, `None` when there is no such object.
    pub(crate) fn object_bytes(&self, name: &str) -> Result<Option<Vec<u8>>, String> {
        let Some(sym) = self
            .symbols
            .iter()
            .find(|s| s.kind == STT_OBJECT && s.name == name)
        else {
            return Ok(None);
        };
        let section = self
            .sections
            .get(usize::from(sym.section))
            .ok_or_else(|| format!("`{name}` lives in missing section {}", sym.section))?;
        let within = sym
            .value
            .checked_sub(section.addr)
            .ok_or_else(|| format!("`{name}` lies before its section"))?;
        if within
            .checked_add(sym.size)
            .is_none_or(|end| end > section.size)
        {
            return Err(format!("`{name}` extends past its section"));
        }
        if section.kind == SHT_NOBITS {
            return Ok(Some(vec![0; sym.size as usize]));
        }
        Ok(Some(
            slice(self.bytes, section.offset + within, sym.size)?.to_vec(),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn non_elf_bytes_are_rejected_without_panicking() {
        assert!(Elf::parse(b"").is_err());
        assert!(Elf::parse(b"\x7fELF\x01\x01").is_err());
        let mut header = vec![0u8; 64];
        header[..4].copy_from_slice(b"\x7fELF");
        header[4] = 2;
        header[5] = 1;
        header[0x28..0x30].copy_from_slice(&u64::MAX.to_le_bytes());
        header[0x3a..0x3c].copy_from_slice(&64u16.to_le_bytes());
        header[0x3c..0x3e].copy_from_slice(&3u16.to_le_bytes());
        assert!(Elf::parse(&header).is_err());
    }
}
