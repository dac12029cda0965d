//! The LLaVA JSON format: a list of records, each with an `id`, its media (`image`: one path
//! or a list; `audio` likewise) and `conversations`, turns `{from, value}` where `from` is
//! `human`, `gpt` or `system`. Each item of media has one placeholder (`<image>`,
//! `<audio>`) in a human turn, in the order of the list.
//!
//! What [`load`] refuses, naming the file and the record (RELIABILITY.md row 9): a file that
//! is not a list of such records; a record whose placeholders and media disagree in number;
//! a placeholder in an assistant turn; a placeholder of media hetpar has no encoder for
//! (`<video>`; any other `<word>` is text); a record with no assistant turn.
//! [`check_files`] adds media files that do not exist.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Deserializer, Serialize};

use crate::error::{DataError, Result, io};

/// The placeholder of one image in a human turn.
pub const IMAGE: &str = "<image>";
/// The placeholder of one audio clip.
pub const AUDIO: &str = "<audio>";

/// One sample.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    /// Its name (a string; a number in the file is read as its decimal text).
    #[serde(deserialize_with = "string_or_number")]
    pub id: String,
    /// Image paths, relative to the image root, in placeholder order.
    #[serde(default, deserialize_with = "media_or_null", skip_serializing_if = "Media::is_empty")]
    pub image: Media,
    /// Audio clip paths (WAV), relative to the audio root, in placeholder order.
    #[serde(default, deserialize_with = "media_or_null", skip_serializing_if = "Media::is_empty")]
    pub audio: Media,
    /// The turns.
    pub conversations: Vec<Turn>,
}

/// A record's media, where `null` (as exported datasets write for a text-only record)
/// stands for none.
fn media_or_null<'de, D: Deserializer<'de>>(d: D) -> std::result::Result<Media, D::Error> {
    Ok(Option::<Media>::deserialize(d)?.unwrap_or_default())
}

/// One path or a list of paths, as LLaVA files write either.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged, expecting = "a path or a list of paths")]
pub enum Media {
    /// A single item.
    One(String),
    /// Any number of items.
    Many(Vec<String>),
}

impl Default for Media {
    fn default() -> Self {
        Media::Many(Vec::new())
    }
}

impl Media {
    /// The paths, in order.
    pub fn paths(&self) -> Vec<&str> {
        match self {
            Media::One(p) => vec![p.as_str()],
            Media::Many(v) => v.iter().map(String::as_str).collect(),
        }
    }

    /// Whether there is no item.
    pub fn is_empty(&self) -> bool {
        matches!(self, Media::Many(v) if v.is_empty())
    }

    /// `paths` as LLaVA writes them: none, one path, or a list.
    pub fn of(paths: Vec<String>) -> Media {
        if paths.len() == 1 {
            Media::One(paths.into_iter().next().expect("one path"))
        } else {
            Media::Many(paths)
        }
    }
}

/// Who speaks a turn.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// The user (`human`): its text is context, never a training target.
    Human,
    /// The assistant (`gpt`): its text is what the model learns to produce.
    Gpt,
    /// A system prompt (context).
    System,
}

impl Role {
    /// The spelling in a LLaVA file's `from`.
    pub fn name(self) -> &'static str {
        match self {
            Role::Human => "human",
            Role::Gpt => "gpt",
            Role::System => "system",
        }
    }
}

/// One turn of a conversation.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Turn {
    /// The speaker.
    pub from: Role,
    /// The text, with placeholders in human turns.
    pub value: String,
}

impl Record {
    /// Whether the record is consistent; the message says what is not.
    pub fn check(&self) -> std::result::Result<(), String> {
        if !self.conversations.iter().any(|t| t.from == Role::Gpt) {
            return Err("no assistant (gpt) turn: nothing to learn".into());
        }
        let (mut images, mut clips) = (0, 0);
        for (i, t) in self.conversations.iter().enumerate() {
            for p in placeholders(&t.value) {
                match p {
                    IMAGE | AUDIO if t.from != Role::Human => {
                        return Err(format!(
                            "turn {i} (from {:?}) holds the placeholder {p}: media go in human turns",
                            t.from.name()
                        ));
                    }
                    IMAGE => images += 1,
                    AUDIO => clips += 1,
                    other => {
                        return Err(format!(
                            "turn {i}: unknown placeholder {other} (hetpar reads {IMAGE} and {AUDIO})"
                        ));
                    }
                }
            }
        }
        for (what, placed, listed) in
            [(IMAGE, images, self.image.paths().len()), (AUDIO, clips, self.audio.paths().len())]
        {
            if placed != listed {
                let s = |n: usize| if n == 1 { "" } else { "s" };
                return Err(format!(
                    "{placed} {what} placeholder{} in the turns but {listed} file{} listed",
                    s(placed),
                    s(listed)
                ));
            }
        }
        Ok(())
    }
}

/// The placeholders LLaVA-family files write for media: the two hetpar reads, and
/// `<video>`, which it has no encoder for (refused by name). Any other `<word>` is text: an
/// answer may well hold HTML (`<b>`, `<br>`), and a misspelt placeholder is caught by the
/// count of placeholders against the files listed.
const MEDIA: [&str; 3] = [IMAGE, AUDIO, "<video>"];

/// Every media placeholder ([`MEDIA`]) in `text`, in order.
fn placeholders(text: &str) -> Vec<&'static str> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some((at, p)) =
        MEDIA.iter().filter_map(|p| rest.find(p).map(|at| (at, *p))).min_by_key(|(at, _)| *at)
    {
        out.push(p);
        rest = &rest[at + p.len()..];
    }
    out
}

fn string_or_number<'de, D: Deserializer<'de>>(d: D) -> std::result::Result<String, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Id {
        S(String),
        N(serde_json::Number),
    }
    Ok(match Id::deserialize(d)? {
        Id::S(s) => s,
        Id::N(n) => n.to_string(),
    })
}

/// Reads a LLaVA JSON file and checks every record.
pub fn load(path: &Path) -> Result<Vec<Record>> {
    let records = read(path)?;
    for (index, r) in records.iter().enumerate() {
        r.check().map_err(|message| record_error(path, index, r, message))?;
    }
    Ok(records)
}

/// Reads a LLaVA JSON file without checking its records (a file that is not a list of
/// records is still an error, with the parser's line and column; an element that is not a
/// record, the first such, names its index and id).
pub fn read(path: &Path) -> Result<Vec<Record>> {
    read_each(path)?
        .into_iter()
        .enumerate()
        .map(|(index, r)| {
            r.map_err(|u| DataError::Record {
                path: path.to_path_buf(),
                index,
                id: u.id,
                message: u.message,
            })
        })
        .collect()
}

/// An element of a records file that is not a record: its `id` (empty where it has none)
/// and what is wrong, the field's path first.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unreadable {
    /// The element's `id`, as text.
    pub id: String,
    /// Why it is not a record.
    pub message: String,
}

/// Reads a LLaVA JSON file element by element: the file must be a JSON list (a UTF-8 byte
/// order mark before it is allowed); each element is a record or, where it is not one
/// (a field missing or of the wrong type, an unknown speaker), an [`Unreadable`], so that
/// one bad record is named, or left out, rather than failing the file.
pub fn read_each(path: &Path) -> Result<Vec<std::result::Result<Record, Unreadable>>> {
    let text = crate::files::read_regular_text(path).map_err(io(path))?;
    let text = text.strip_prefix('\u{feff}').unwrap_or(&text);
    let elements: Vec<serde_json::Value> = serde_json::from_str(text).map_err(|e| {
        // JSON Lines (one record a line) reads as one object followed by more.
        let hint = if text.trim_start().starts_with('{') {
            " (the file holds an object; hetpar reads a JSON list of records, [ ... ], not JSON Lines)"
        } else {
            ""
        };
        DataError::Format { path: path.to_path_buf(), message: format!("not a LLaVA JSON list: {e}{hint}") }
    })?;
    Ok(elements
        .into_iter()
        .map(|v| {
            let id = match v.get("id") {
                Some(serde_json::Value::String(s)) => s.clone(),
                Some(other) => other.to_string(),
                None => String::new(),
            };
            serde_path_to_error::deserialize::<_, Record>(v).map_err(|e| {
                let at = e.path().to_string();
                let message = if at == "." {
                    format!("not a LLaVA record: {}", e.inner())
                } else {
                    format!("not a LLaVA record: {at}: {}", e.inner())
                };
                Unreadable { id, message }
            })
        })
        .collect())
}

/// Checks that every image exists under `image_root` and every clip under `audio_root`.
pub fn check_files(
    path: &Path,
    records: &[Record],
    image_root: &Path,
    audio_root: &Path,
) -> Result<()> {
    for (index, r) in records.iter().enumerate() {
        for (root, media) in [(image_root, &r.image), (audio_root, &r.audio)] {
            for p in media.paths() {
                let file: PathBuf = root.join(p);
                if let Some(message) = not_a_file(&file) {
                    return Err(record_error(path, index, r, message));
                }
            }
        }
    }
    Ok(())
}

/// Why a record's media `file` cannot be read, where it cannot: it is not there, or a
/// directory is ([`crate::dataset::MISSING`] begins either).
pub fn not_a_file(file: &Path) -> Option<String> {
    let what = if file.is_dir() { ": a directory is there, not a file" } else { "" };
    (!file.is_file()).then(|| format!("{} {}{what}", crate::dataset::MISSING, file.display()))
}

fn record_error(path: &Path, index: usize, r: &Record, message: String) -> DataError {
    DataError::Record { path: path.to_path_buf(), index, id: r.id.clone(), message }
}

/// Writes `records` as a LLaVA JSON file (pretty-printed, one field per line).
pub fn save(path: &Path, records: &[Record]) -> Result<()> {
    let text = serde_json::to_string_pretty(records)
        .map_err(|e| DataError::Encode { path: path.to_path_buf(), message: e.to_string() })?;
    std::fs::write(path, text + "\n").map_err(io(path))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::{Media, Record, placeholders};

    fn record(json: &str) -> Record {
        serde_json::from_str(json).unwrap()
    }

    #[test]
    fn placeholders_are_the_media_words_and_other_tags_are_text() {
        assert_eq!(
            placeholders("<image>\nIs <b>this</b> a <video>? a < b > c <x_y> <> <audio><image>"),
            ["<image>", "<video>", "<audio>", "<image>"]
        );
        assert!(placeholders("Use the <b> tag, then <br> and <Image>").is_empty());
    }

    #[test]
    fn one_path_a_list_or_none_and_numeric_ids_read() {
        let r = record(
            r#"{"id": 7, "image": "a.png", "conversations": [{"from": "human", "value": "<image>\nWhat?"}, {"from": "gpt", "value": "a cat"}]}"#,
        );
        assert_eq!((r.id.as_str(), r.image.paths()), ("7", vec!["a.png"]));
        assert!(r.audio.is_empty());
        r.check().unwrap();
        let r = record(
            r#"{"id": "x", "image": ["a.png", "b.png"], "audio": ["c.wav"], "conversations": [{"from": "human", "value": "<image><image><audio> and?"}, {"from": "gpt", "value": "ok"}]}"#,
        );
        r.check().unwrap();
        assert_eq!(Media::of(vec!["a".into()]), Media::One("a".into()));
    }

    #[test]
    fn a_file_that_is_not_a_list_names_itself_and_the_place() {
        let path = std::env::temp_dir().join(format!("hetpar-llava-{}.json", std::process::id()));
        std::fs::write(&path, "{\"id\": 1}").unwrap();
        let e = super::load(&path).unwrap_err().to_string();
        assert!(
            e.contains(&format!("{}: not a LLaVA JSON list: invalid type", path.display())),
            "{e}"
        );
        assert!(e.contains("line 1 column"), "{e}");
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn inconsistent_records_say_why() {
        let cases = [
            (
                r#"{"id": "a", "image": ["x.png", "y.png"], "conversations": [{"from": "human", "value": "<image>"}, {"from": "gpt", "value": "."}]}"#,
                "1 <image> placeholder in the turns but 2 files listed",
            ),
            (
                r#"{"id": "b", "conversations": [{"from": "human", "value": "<video> what?"}, {"from": "gpt", "value": "."}]}"#,
                "turn 0: unknown placeholder <video>",
            ),
            (
                r#"{"id": "c", "audio": "c.wav", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "<audio>"}]}"#,
                "turn 1 (from \"gpt\") holds the placeholder <audio>",
            ),
            (
                r#"{"id": "d", "conversations": [{"from": "human", "value": "hi"}]}"#,
                "no assistant (gpt) turn",
            ),
        ];
        for (json, want) in cases {
            let e = record(json).check().unwrap_err();
            assert!(e.contains(want), "{e}");
        }
    }
}
