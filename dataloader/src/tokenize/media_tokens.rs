//! The template's image / audio tokens against a tokenizer, checked before any data is read,
//! with a working choice named when they are missing; and `[template] image = false`.
//!
//! Without this check a tokenizer that lacks `<|image|>` (Qwen3's, for one) rejects every
//! multimodal sample one by one and the pack "succeeds" on the text-only rest.

use std::fmt;

use serde::de::{self, MapAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::chat::{ChatTemplate, MediaFormat};
use super::{TokenizeError, Tokenizer};

/// Known placeholder families: `(pad, begin, end, who uses it)`.
const IMAGE_FAMILIES: &[(&str, Option<&str>, Option<&str>, &str)] = &[
    (
        "<|image_pad|>",
        Some("<|vision_start|>"),
        Some("<|vision_end|>"),
        "Qwen2-VL / Qwen2.5-VL / Qwen3",
    ),
    ("<image>", None, None, "LLaVA-HF"),
    ("<|image|>", None, None, "Braid's byte tokenizer"),
];
const AUDIO_FAMILIES: &[(&str, Option<&str>, Option<&str>, &str)] = &[
    (
        "<|audio_pad|>",
        Some("<|audio_start|>"),
        Some("<|audio_end|>"),
        "Qwen3-Omni",
    ),
    (
        "<|AUDIO|>",
        Some("<|audio_bos|>"),
        Some("<|audio_eos|>"),
        "Qwen2-Audio / Qwen2.5-Omni",
    ),
    ("<audio>", None, None, "LLaVA-style"),
    ("<|audio|>", None, None, "Braid's byte tokenizer"),
];

/// Fails when the template's `[template.image]` or `[template.audio]` tokens are not single
/// tokens of `tokenizer` (`name` labels it). A modality set to `false` is not checked.
pub fn check_media_tokens(
    template: &ChatTemplate,
    tokenizer: &dyn Tokenizer,
    name: &str,
) -> Result<(), TokenizeError> {
    for (key, fmt, families) in [
        ("image", &template.image, IMAGE_FAMILIES),
        ("audio", &template.audio, AUDIO_FAMILIES),
    ] {
        let Some(fmt) = fmt else { continue };
        let tokens = [
            ("pad", Some(fmt.pad.as_str())),
            ("begin", fmt.begin.as_deref()),
            ("end", fmt.end.as_deref()),
        ];
        let Some((which, token)) = tokens.iter().find_map(|(which, t)| {
            t.filter(|t| tokenizer.token_id(t).is_none())
                .map(|t| (*which, t))
        }) else {
            continue;
        };
        let choice = families.iter().find(|(pad, begin, end, _)| {
            [Some(*pad), *begin, *end]
                .into_iter()
                .flatten()
                .all(|t| tokenizer.token_id(t).is_some())
        });
        let advice = match choice {
            Some((pad, begin, end, who)) => {
                let mut keys = format!("pad = \"{pad}\"");
                if let Some(b) = begin {
                    keys.push_str(&format!(", begin = \"{b}\""));
                }
                if let Some(e) = end {
                    keys.push_str(&format!(", end = \"{e}\""));
                }
                format!("this tokenizer has the {who} {key} tokens: set [template.{key}] {keys}")
            }
            None => format!(
                "this tokenizer has no {key} tokens that Braid knows ({}); add them to tokenizer.json's \"added_tokens\" (and grow the model's embedding), or set [template] {key} = false if the data holds no {key}",
                families
                    .iter()
                    .map(|(pad, ..)| *pad)
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        };
        return Err(TokenizeError::Template(format!(
            "[template.{key}] {which} = \"{token}\" is not a single token of {name}; {advice}"
        )));
    }
    Ok(())
}

/// Serde for `ChatTemplate::image` / `audio`: a `MediaFormat` table, or `false` for none (also
/// how `None` is written, so the config round-trips through TOML and JSON; `null` reads as none).
pub(crate) mod media_or_off {
    use super::*;

    pub fn serialize<S: Serializer>(v: &Option<MediaFormat>, s: S) -> Result<S::Ok, S::Error> {
        match v {
            Some(m) => m.serialize(s),
            None => s.serialize_bool(false),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<MediaFormat>, D::Error> {
        d.deserialize_any(MediaOrOff)
    }

    struct MediaOrOff;

    impl<'de> Visitor<'de> for MediaOrOff {
        type Value = Option<MediaFormat>;

        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a table with pad (and optional begin, end), or false for none")
        }

        fn visit_bool<E: de::Error>(self, v: bool) -> Result<Self::Value, E> {
            if v {
                return Err(E::custom(
                    "true is not a placeholder: give a table with pad (and begin/end), or false",
                ));
            }
            Ok(None)
        }

        fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }

        fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }

        fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
            MediaFormat::deserialize(de::value::MapAccessDeserializer::new(map)).map(Some)
        }
    }
}
