//! The chat template: a serde config ([`ChatTemplate`]), resolved once against a
//! tokenizer ([`CompiledTemplate`]), that lays a conversation out as token ids with a
//! loss mask and the spans of image / audio placeholder tokens.

use serde::{Deserialize, Serialize};

use super::{
    Message, Modality, Part, PlaceholderCounts, Result, Role, TokenizeError, TokenizedSample,
    Tokenizer,
};

/// Upper bound on a sample's length: placeholder counts beyond it are a caller bug, and
/// the bound keeps a bad count from allocating without limit.
pub const MAX_SAMPLE_TOKENS: usize = 1 << 28;

/// Text around one role's turns. Strings may contain the tokenizer's special tokens
/// (`<|im_start|>`), which are split out; the rest is encoded as plain text.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RoleFormat {
    /// Before the content (ChatML: `<|im_start|>user\n`); never a loss target in
    /// assistant-only mode.
    pub prefix: String,
    /// Closes the turn (ChatML: `<|im_end|>`); a loss target in assistant turns: the
    /// model learns to end its answer.
    pub suffix: String,
    /// After the suffix, before the next turn (ChatML: `\n`); a loss target only with
    /// [`LossOn::All`].
    #[serde(default)]
    pub separator: String,
}

impl RoleFormat {
    /// ChatML: `<|im_start|>{role}\n ... <|im_end|>` then `\n`.
    pub fn chatml(role: Role) -> Self {
        RoleFormat {
            prefix: format!("<|im_start|>{role}\n"),
            suffix: "<|im_end|>".into(),
            separator: "\n".into(),
        }
    }
}

/// Placeholder tokens of one image or clip: `[begin] pad x count [end]`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MediaFormat {
    /// The token repeated once per embedding (`<|image_pad|>`).
    pub pad: String,
    /// Token before the run (Qwen2-VL: `<|vision_start|>`).
    #[serde(default)]
    pub begin: Option<String>,
    /// Token after the run (Qwen2-VL: `<|vision_end|>`).
    #[serde(default)]
    pub end: Option<String>,
}

/// Which tokens are training targets.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LossOn {
    /// Assistant message content and the assistant turn's suffix (and EOS after a final
    /// assistant turn).
    #[default]
    AssistantOnly,
    /// Every token but placeholders and the first token.
    All,
}

/// A chat template. The default is ChatML as Qwen writes it, with `<|image|>` and
/// `<|audio|>` placeholders (the [`ByteTokenizer`](super::ByteTokenizer)'s); see
/// [`ChatTemplate::qwen2_vl`] for Qwen's own placeholder tokens.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ChatTemplate {
    pub system: RoleFormat,
    pub user: RoleFormat,
    pub assistant: RoleFormat,
    /// System message inserted when a conversation has none.
    pub default_system: Option<String>,
    /// Token text put first (Llama 3: `<|begin_of_text|>`).
    pub bos: Option<String>,
    /// Token text put last.
    pub eos: Option<String>,
    /// `[template.image]`; `image = false`: no image tokens (image samples are rejected).
    #[serde(with = "super::media_tokens::media_or_off")]
    pub image: Option<MediaFormat>,
    /// `[template.audio]`; `audio = false`: no audio tokens (audio samples are rejected).
    #[serde(with = "super::media_tokens::media_or_off")]
    pub audio: Option<MediaFormat>,
    pub loss: LossOn,
}

impl Default for ChatTemplate {
    fn default() -> Self {
        ChatTemplate {
            system: RoleFormat::chatml(Role::System),
            user: RoleFormat::chatml(Role::User),
            assistant: RoleFormat::chatml(Role::Assistant),
            default_system: None,
            bos: None,
            eos: None,
            image: Some(MediaFormat {
                pad: "<|image|>".into(),
                begin: None,
                end: None,
            }),
            audio: Some(MediaFormat {
                pad: "<|audio|>".into(),
                begin: None,
                end: None,
            }),
            loss: LossOn::AssistantOnly,
        }
    }
}

impl ChatTemplate {
    /// ChatML with Qwen2-VL's image tokens (`<|vision_start|><|image_pad|>..<|vision_end|>`)
    /// and Qwen3-Omni's audio tokens (`<|audio_start|><|audio_pad|>..<|audio_end|>`).
    pub fn qwen2_vl() -> Self {
        let media = |b: &str, p: &str, e: &str| MediaFormat {
            pad: p.into(),
            begin: Some(b.into()),
            end: Some(e.into()),
        };
        ChatTemplate {
            image: Some(media("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")),
            audio: Some(media("<|audio_start|>", "<|audio_pad|>", "<|audio_end|>")),
            ..ChatTemplate::default()
        }
    }
}

/// Token ids of one [`RoleFormat`].
#[derive(Clone, Debug)]
struct RoleIds {
    prefix: Vec<u32>,
    suffix: Vec<u32>,
    separator: Vec<u32>,
}

/// Token ids of one [`MediaFormat`].
#[derive(Clone, Copy, Debug)]
struct MediaIds {
    pad: u32,
    begin: Option<u32>,
    end: Option<u32>,
}

/// A [`ChatTemplate`] resolved against a tokenizer: every template string encoded once.
#[derive(Debug)]
pub struct CompiledTemplate<'t> {
    tokenizer: &'t dyn Tokenizer,
    template: ChatTemplate,
    system: RoleIds,
    user: RoleIds,
    assistant: RoleIds,
    bos: Option<u32>,
    eos: Option<u32>,
    /// The reason the template cannot place images / clips with this tokenizer, if so;
    /// kept so that text-only data works with a tokenizer that lacks the tokens.
    image: std::result::Result<MediaIds, String>,
    audio: std::result::Result<MediaIds, String>,
    /// Placeholder and marker ids: message text must not encode to any of them.
    reserved: Vec<(u32, &'static str)>,
    /// Ids of `template.default_system`.
    default_system: Option<Vec<u32>>,
}

/// `text` with the tokenizer's special tokens split out (leftmost, longest match) and the
/// text between them encoded as plain text.
fn encode_template(
    tok: &dyn Tokenizer,
    specials: &[(String, u32)],
    text: &str,
) -> Result<Vec<u32>> {
    let mut ids = Vec::new();
    let mut plain_start = 0;
    let mut i = 0;
    while i < text.len() {
        let rest = &text[i..];
        // `specials` is sorted longest first, so the first match is the longest.
        if let Some((s, id)) = specials.iter().find(|(s, _)| rest.starts_with(s.as_str())) {
            ids.extend(tok.encode(&text[plain_start..i])?);
            ids.push(*id);
            i += s.len();
            plain_start = i;
        } else {
            i += rest.chars().next().map_or(1, char::len_utf8);
        }
    }
    ids.extend(tok.encode(&text[plain_start..])?);
    Ok(ids)
}

/// Message `message`'s `text` encoded as plain text, refused when it contains a
/// `reserved` id (a placeholder or marker: it would corrupt the spans).
fn check_text(
    tok: &dyn Tokenizer,
    reserved: &[(u32, &'static str)],
    text: &str,
    message: usize,
) -> Result<Vec<u32>> {
    let ids = tok.encode(text).map_err(|e| match e {
        TokenizeError::Library { reason, .. } => TokenizeError::Library {
            what: format!("message {message}"),
            reason,
        },
        e => e,
    })?;
    if let Some(&(id, what)) = reserved.iter().find(|(r, _)| ids.contains(r)) {
        return Err(TokenizeError::ReservedTokenInText { message, what, id });
    }
    Ok(ids)
}

fn single_token(tok: &dyn Tokenizer, what: &str, token: &str) -> Result<u32> {
    tok.token_id(token)
        .ok_or_else(|| TokenizeError::UnknownToken {
            what: what.to_string(),
            token: token.to_string(),
        })
}

fn media_ids(
    tok: &dyn Tokenizer,
    name: &str,
    fmt: Option<&MediaFormat>,
) -> std::result::Result<MediaIds, String> {
    let fmt = fmt.ok_or_else(|| format!("the chat template has no {name} placeholder"))?;
    let one = |what: &str, t: &str| {
        single_token(tok, &format!("{name} {what}"), t).map_err(|e| e.to_string())
    };
    Ok(MediaIds {
        pad: one("placeholder", &fmt.pad)?,
        begin: fmt
            .begin
            .as_deref()
            .map(|t| one("begin marker", t))
            .transpose()?,
        end: fmt
            .end
            .as_deref()
            .map(|t| one("end marker", t))
            .transpose()?,
    })
}

impl<'t> CompiledTemplate<'t> {
    /// Resolves `template` against `tokenizer`. Role strings, BOS and EOS must resolve;
    /// a missing image / audio token is reported when a sample first needs it (and by
    /// [`CompiledTemplate::media_error`]).
    pub fn new(template: &ChatTemplate, tokenizer: &'t dyn Tokenizer) -> Result<Self> {
        let mut specials: Vec<(String, u32)> = tokenizer
            .special_tokens()
            .into_iter()
            .filter(|(s, _)| !s.is_empty())
            .collect();
        specials.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then(a.1.cmp(&b.1)));
        let role = |f: &RoleFormat| -> Result<RoleIds> {
            Ok(RoleIds {
                prefix: encode_template(tokenizer, &specials, &f.prefix)?,
                suffix: encode_template(tokenizer, &specials, &f.suffix)?,
                separator: encode_template(tokenizer, &specials, &f.separator)?,
            })
        };
        let image = media_ids(tokenizer, "image", template.image.as_ref());
        let audio = media_ids(tokenizer, "audio", template.audio.as_ref());
        let mut reserved = Vec::new();
        for (m, pad, marker) in [
            (&image, "image placeholder", "image marker"),
            (&audio, "audio placeholder", "audio marker"),
        ] {
            if let Ok(m) = m {
                reserved.push((m.pad, pad));
                reserved.extend(
                    [m.begin, m.end]
                        .into_iter()
                        .flatten()
                        .map(|id| (id, marker)),
                );
            }
        }
        if let (Ok(i), Ok(a)) = (&image, &audio)
            && i.pad == a.pad
        {
            return Err(TokenizeError::Template(format!(
                "image and audio use the same placeholder token id {}",
                i.pad
            )));
        }
        let default_system = match &template.default_system {
            Some(text) => Some(
                check_text(tokenizer, &reserved, text, 0).map_err(|e| match e {
                    TokenizeError::ReservedTokenInText { what, id, .. } => TokenizeError::Template(
                        format!("default_system encodes to the {what} token id {id}"),
                    ),
                    e => e,
                })?,
            ),
            None => None,
        };
        Ok(CompiledTemplate {
            default_system,
            tokenizer,
            system: role(&template.system)?,
            user: role(&template.user)?,
            assistant: role(&template.assistant)?,
            bos: template
                .bos
                .as_deref()
                .map(|t| single_token(tokenizer, "bos", t))
                .transpose()?,
            eos: template
                .eos
                .as_deref()
                .map(|t| single_token(tokenizer, "eos", t))
                .transpose()?,
            image,
            audio,
            reserved,
            template: template.clone(),
        })
    }

    pub fn template(&self) -> &ChatTemplate {
        &self.template
    }

    pub fn tokenizer(&self) -> &'t dyn Tokenizer {
        self.tokenizer
    }

    /// Why this template cannot place `modality` items with its tokenizer, if it cannot.
    pub fn media_error(&self, modality: Modality) -> Option<&str> {
        match modality {
            Modality::Image => self.image.as_ref().err().map(String::as_str),
            Modality::Audio => self.audio.as_ref().err().map(String::as_str),
        }
    }

    /// The placeholder token id of `modality`, when the tokenizer has it.
    pub fn placeholder_id(&self, modality: Modality) -> Option<u32> {
        match modality {
            Modality::Image => self.image.as_ref().ok().map(|m| m.pad),
            Modality::Audio => self.audio.as_ref().ok().map(|m| m.pad),
        }
    }

    fn role(&self, role: Role) -> &RoleIds {
        match role {
            Role::System => &self.system,
            Role::User => &self.user,
            Role::Assistant => &self.assistant,
        }
    }

    /// Lays out `messages`; see [`tokenize_sample`].
    pub fn tokenize(
        &self,
        messages: &[Message],
        counts: &PlaceholderCounts,
    ) -> Result<TokenizedSample> {
        if messages.is_empty() {
            return Err(TokenizeError::EmptyConversation);
        }
        let all = self.template.loss == LossOn::All;
        if !all && !messages.iter().any(|m| m.role == Role::Assistant) {
            return Err(TokenizeError::NoAssistantTurn);
        }
        if let Some(index) = messages.iter().skip(1).position(|m| m.role == Role::System) {
            return Err(TokenizeError::SystemNotFirst { index: index + 1 });
        }
        let mut b = Builder {
            out: TokenizedSample::default(),
            next: [0, 0],
        };
        if let Some(bos) = self.bos {
            b.push(&[bos], false);
        }
        if messages[0].role != Role::System
            && let Some(text) = &self.default_system
        {
            let ids = &self.system;
            for part in [&ids.prefix, text, &ids.suffix, &ids.separator] {
                b.push(part, all);
            }
        }
        for (i, m) in messages.iter().enumerate() {
            self.turn(&mut b, i, m, counts)?;
        }
        if let Some(eos) = self.eos {
            let last_assistant = messages.last().is_some_and(|m| m.role == Role::Assistant);
            b.push(&[eos], all || last_assistant);
        }
        for (modality, given) in [
            (Modality::Image, counts.images.len()),
            (Modality::Audio, counts.audio.len()),
        ] {
            let referenced = b.next[modality as usize];
            if referenced != given {
                return Err(TokenizeError::UnreferencedMedia {
                    modality,
                    count: given,
                    referenced,
                });
            }
        }
        let mut out = b.out;
        // Nothing predicts the first token.
        if let Some(m) = out.loss_mask.first_mut() {
            *m = 0;
        }
        let placeholders: usize = out
            .image_spans
            .iter()
            .chain(&out.audio_spans)
            .map(|s| s.1)
            .sum();
        out.text_tokens = out.ids.len() - placeholders;
        Ok(out)
    }

    /// Message `index`.
    fn turn(
        &self,
        b: &mut Builder,
        index: usize,
        m: &Message,
        counts: &PlaceholderCounts,
    ) -> Result<()> {
        let all = self.template.loss == LossOn::All;
        let train = all || m.role == Role::Assistant;
        let ids = self.role(m.role);
        b.push(&ids.prefix, all);
        for part in &m.parts {
            match part {
                Part::Text(text) => {
                    let t = check_text(self.tokenizer, &self.reserved, text, index)?;
                    b.push(&t, train);
                }
                &Part::Image(k) => self.media(b, index, Modality::Image, k, &counts.images, all)?,
                &Part::Audio(k) => self.media(b, index, Modality::Audio, k, &counts.audio, all)?,
            }
        }
        b.push(&ids.suffix, train);
        b.push(&ids.separator, all);
        Ok(())
    }

    fn media(
        &self,
        b: &mut Builder,
        message: usize,
        modality: Modality,
        index: usize,
        counts: &[usize],
        all: bool,
    ) -> Result<()> {
        let fmt = match modality {
            Modality::Image => &self.image,
            Modality::Audio => &self.audio,
        };
        let fmt = fmt
            .as_ref()
            .map_err(|reason| TokenizeError::NoPlaceholder {
                message,
                modality,
                reason: reason.clone(),
            })?;
        let expected = b.next[modality as usize];
        if index != expected {
            return Err(TokenizeError::MediaOrder {
                message,
                modality,
                index,
                expected,
            });
        }
        let &n = counts.get(index).ok_or(TokenizeError::MissingCount {
            message,
            modality,
            index,
            given: counts.len(),
        })?;
        if n == 0 {
            return Err(TokenizeError::ZeroCount {
                message,
                modality,
                index,
            });
        }
        if b.out.ids.len().saturating_add(n) > MAX_SAMPLE_TOKENS {
            return Err(TokenizeError::Template(format!(
                "message {message}: {modality} {index} with {n} placeholder tokens makes the sample longer than {MAX_SAMPLE_TOKENS} tokens"
            )));
        }
        b.next[modality as usize] += 1;
        if let Some(id) = fmt.begin {
            b.push(&[id], all);
        }
        let start = b.out.ids.len();
        b.out.ids.resize(start + n, fmt.pad);
        b.out.loss_mask.resize(start + n, 0);
        match modality {
            Modality::Image => b.out.image_spans.push((start, n)),
            Modality::Audio => b.out.audio_spans.push((start, n)),
        }
        if let Some(id) = fmt.end {
            b.push(&[id], all);
        }
        Ok(())
    }
}

/// Output under construction; `next[m]` is the index of the next item of modality `m`.
struct Builder {
    out: TokenizedSample,
    next: [usize; 2],
}

impl Builder {
    fn push(&mut self, ids: &[u32], target: bool) {
        self.out.ids.extend_from_slice(ids);
        self.out
            .loss_mask
            .resize(self.out.ids.len(), u8::from(target));
    }
}

/// Tokenizes one conversation with `template` (compiled for this call; compile once with
/// [`CompiledTemplate::new`] when tokenizing many).
///
/// `counts` gives the placeholder tokens of each image and clip; every item must be
/// referenced exactly once, in order (image k is the k-th `Part::Image`), so that
/// `image_spans[k]` is image k's span. Errors: empty conversation, a system message not
/// first, no assistant turn under [`LossOn::AssistantOnly`], a missing / zero / unused
/// count, an item out of order, a placeholder the template or tokenizer lacks, text that
/// encodes to a placeholder or marker id.
pub fn tokenize_sample(
    messages: &[Message],
    template: &ChatTemplate,
    tokenizer: &dyn Tokenizer,
    counts: &PlaceholderCounts,
) -> Result<TokenizedSample> {
    CompiledTemplate::new(template, tokenizer)?.tokenize(messages, counts)
}
