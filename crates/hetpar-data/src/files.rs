//! Reading the files a user or a run names, so that something other than a file in a
//! file's place is refused rather than read without end: a device such as `/dev/zero`
//! never ends, `/dev/full` neither, and opening a FIFO waits for a writer that may never
//! come (RELIABILITY.md: never a hang; every size read from a file is bounds-checked).

use std::fs::{File, FileType};
use std::io::{self, Read};
use std::path::Path;

/// Opens `path` to read if it is a regular file (links followed), checked before it is
/// opened; anything else is refused saying what it is.
pub fn open_regular(path: &Path) -> io::Result<File> {
    let kind = std::fs::metadata(path)?.file_type();
    if !kind.is_file() {
        let what = describe(kind);
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{what}, not a regular file"),
        ));
    }
    File::open(path)
}

/// The whole of regular file `path` ([`open_regular`]).
pub fn read_regular(path: &Path) -> io::Result<Vec<u8>> {
    let mut bytes = Vec::new();
    open_regular(path)?.read_to_end(&mut bytes)?;
    Ok(bytes)
}

/// The whole of regular file `path` as UTF-8 text ([`open_regular`]).
pub fn read_regular_text(path: &Path) -> io::Result<String> {
    let mut text = String::new();
    open_regular(path)?.read_to_string(&mut text)?;
    Ok(text)
}

/// The whole of `path` as UTF-8 text, refused past `limit` bytes. A pipe is read (a
/// shell's `<(...)`), so this is for what a user names on the command line, a config say,
/// whose limit stands far above any real one: a device that never ends is refused at the
/// limit rather than read into memory.
pub fn read_capped_text(path: &Path, limit: u64) -> io::Result<String> {
    let file = File::open(path)?;
    // Bytes first: the limit is said before any question of UTF-8 (a device's bytes).
    let mut bytes = Vec::new();
    file.take(limit + 1).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > limit {
        let kind = std::fs::metadata(path).map(|m| describe(m.file_type()));
        let what = kind.map_or_else(|_| "it".to_string(), |k| format!("it ({k})"));
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{what} holds more than {limit} bytes, more than such a file ever does"),
        ));
    }
    String::from_utf8(bytes).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
}

/// What a file of type `kind` is, in words: "a regular file", "a directory", "a FIFO"...
pub fn describe(kind: FileType) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    if kind.is_file() {
        "a regular file"
    } else if kind.is_dir() {
        "a directory"
    } else if kind.is_char_device() {
        "a character device"
    } else if kind.is_block_device() {
        "a block device"
    } else if kind.is_fifo() {
        "a FIFO"
    } else if kind.is_socket() {
        "a socket"
    } else {
        "not a file"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_and_directories_are_refused_saying_what_they_are() {
        let e = read_regular(Path::new("/dev/zero")).expect_err("a device");
        assert_eq!(e.to_string(), "a character device, not a regular file");
        let e = read_regular_text(Path::new("/")).expect_err("a directory");
        assert_eq!(e.to_string(), "a directory, not a regular file");
        for device in ["/dev/zero", "/dev/urandom"] {
            let e = read_capped_text(Path::new(device), 1024).expect_err("endless");
            assert_eq!(
                e.to_string(),
                "it (a character device) holds more than 1024 bytes, more than such a file ever does"
            );
        }
    }

    #[test]
    fn a_fifo_is_refused_before_it_is_opened() {
        let dir = std::env::temp_dir().join(format!("hetpar-fifo-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let fifo = dir.join("f");
        let made = std::process::Command::new("mkfifo").arg(&fifo).status().expect("mkfifo");
        assert!(made.success());
        // Opening it would wait for a writer: the test would hang.
        let e = open_regular(&fifo).expect_err("a FIFO");
        assert_eq!(e.to_string(), "a FIFO, not a regular file");
        std::fs::remove_dir_all(&dir).expect("cleanup");
    }

    #[test]
    fn files_read_whole() {
        let dir = std::env::temp_dir().join(format!("hetpar-files-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join("a.toml");
        std::fs::write(&path, "x = 1\n").expect("write");
        assert_eq!(read_regular_text(&path).expect("read"), "x = 1\n");
        assert_eq!(read_capped_text(&path, 6).expect("at the limit"), "x = 1\n");
        assert!(read_capped_text(&path, 5).is_err());
        std::fs::remove_dir_all(&dir).expect("cleanup");
    }
}
