//! Tokenization: byte and Hugging Face tokenizers against Python `tokenizers`
//! references, the chat template's exact layout, loss masks, placeholder spans, and
//! every rejection.
#![allow(clippy::unwrap_used)]

use std::path::PathBuf;
use std::time::Instant;

use braid_dataloader::tokenize::{
    ByteTokenizer, ChatTemplate, CompiledTemplate, HfTokenizer, LossOn, MediaFormat, Message,
    Modality, Part, PlaceholderCounts, Role, RoleFormat, TokenizeError, TokenizedSample, Tokenizer,
    audio_tokens, tokenize_sample, vision_tokens,
};
use serde_json::Value;

// ByteTokenizer special ids.
const IM_START: u32 = 256;
const IM_END: u32 = 257;
const IMAGE: u32 = 258;
const AUDIO: u32 = 259;
const EOT: u32 = 260;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/tokenizer")
        .join(name)
}

fn tiny() -> HfTokenizer {
    HfTokenizer::from_file(fixture("tiny_bpe.json")).unwrap()
}

fn json(name: &str) -> Value {
    serde_json::from_str(&std::fs::read_to_string(fixture(name)).unwrap()).unwrap()
}

fn ids_of(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn bytes(s: &str) -> Vec<u32> {
    s.bytes().map(u32::from).collect()
}

fn user(parts: Vec<Part>) -> Message {
    Message {
        role: Role::User,
        parts,
    }
}

fn text(s: &str) -> Part {
    Part::Text(s.into())
}

fn counts(images: &[usize], audio: &[usize]) -> PlaceholderCounts {
    PlaceholderCounts {
        images: images.to_vec(),
        audio: audio.to_vec(),
    }
}

/// Structural invariants every tokenized sample must satisfy.
fn check_invariants(s: &TokenizedSample, image_pad: u32, audio_pad: Option<u32>) {
    assert_eq!(s.ids.len(), s.loss_mask.len());
    assert!(s.loss_mask.iter().all(|&m| m <= 1));
    let mut last_end = 0;
    let mut spans: Vec<_> = s.image_spans.iter().map(|&sp| (sp, image_pad)).collect();
    spans.extend(
        s.audio_spans
            .iter()
            .map(|&sp| (sp, audio_pad.unwrap_or(u32::MAX))),
    );
    spans.sort();
    let mut total = 0;
    for ((start, len), pad) in spans {
        assert!(start >= last_end && len > 0 && start + len <= s.ids.len());
        assert!(
            s.ids[start..start + len].iter().all(|&id| id == pad),
            "span {start}+{len}"
        );
        assert!(s.loss_mask[start..start + len].iter().all(|&m| m == 0));
        last_end = start + len;
        total += len;
    }
    assert_eq!(s.text_tokens, s.ids.len() - total);
    // No placeholder outside a span.
    let pads = s
        .ids
        .iter()
        .filter(|&&id| id == image_pad || Some(id) == audio_pad)
        .count();
    assert_eq!(pads, total);
}

// ---------------------------------------------------------------- ByteTokenizer

#[test]
fn byte_round_trip_unicode() {
    let t = ByteTokenizer;
    for s in [
        "",
        "hello",
        "Grüße 東京 🎉👩‍👩‍👧 \u{0}\u{FEFF}",
        "<|im_end|> typed",
    ] {
        let ids = t.encode(s).unwrap();
        assert_eq!(ids, bytes(s));
        assert!(ids.iter().all(|&i| i < 256));
        assert_eq!(t.decode(&ids).unwrap(), s);
    }
    assert_eq!(t.vocab_size(), 261);
    assert_eq!(t.token_id("<|im_start|>"), Some(IM_START));
    assert_eq!(t.token_id("<|im_end|>"), Some(IM_END));
    assert_eq!(t.token_id("<|image|>"), Some(IMAGE));
    assert_eq!(t.token_id("<|audio|>"), Some(AUDIO));
    assert_eq!(t.token_id("<|endoftext|>"), Some(EOT));
    assert_eq!(t.token_id("a"), None);
    assert_eq!(
        t.decode(&[IM_START, 104, 105, IM_END]).unwrap(),
        "<|im_start|>hi<|im_end|>"
    );
    // A split UTF-8 sequence decodes lossily, an unknown id is an error.
    assert_eq!(t.decode(&[0xE6, 0x9D]).unwrap(), "\u{FFFD}");
    assert!(matches!(
        t.decode(&[261]),
        Err(TokenizeError::InvalidId { id: 261, .. })
    ));
}

/// The exact layout of a 2-turn chat with an image and a clip, and its loss mask.
#[test]
fn chat_layout_exact_with_byte_tokenizer() {
    let msgs = vec![
        Message::text(Role::System, "Be brief."),
        user(vec![
            text("See "),
            Part::Image(0),
            text(" and hear "),
            Part::Audio(0),
        ]),
        Message::text(Role::Assistant, "A dog."),
        user(vec![text("Sure?")]),
        Message::text(Role::Assistant, "Yes."),
    ];
    let s = tokenize_sample(
        &msgs,
        &ChatTemplate::default(),
        &ByteTokenizer,
        &counts(&[3], &[2]),
    )
    .unwrap();

    let mut ids = Vec::new();
    let mut mask = Vec::new();
    // Appends `part` with mask value `m`; returns where it starts.
    let mut add = |part: Vec<u32>, m: u8| {
        let at = ids.len();
        mask.extend(std::iter::repeat_n(m, part.len()));
        ids.extend(part);
        at
    };
    add(
        [
            vec![IM_START],
            bytes("system\nBe brief."),
            vec![IM_END],
            bytes("\n"),
        ]
        .concat(),
        0,
    );
    add([vec![IM_START], bytes("user\nSee ")].concat(), 0);
    let image_start = add(vec![IMAGE; 3], 0);
    add(bytes(" and hear "), 0);
    let audio_start = add(vec![AUDIO; 2], 0);
    add([vec![IM_END], bytes("\n")].concat(), 0);
    add([vec![IM_START], bytes("assistant\n")].concat(), 0);
    add([bytes("A dog."), vec![IM_END]].concat(), 1);
    add(bytes("\n"), 0);
    add(
        [
            vec![IM_START],
            bytes("user\nSure?"),
            vec![IM_END],
            bytes("\n"),
        ]
        .concat(),
        0,
    );
    add([vec![IM_START], bytes("assistant\n")].concat(), 0);
    add([bytes("Yes."), vec![IM_END]].concat(), 1);
    add(bytes("\n"), 0);

    assert_eq!(s.ids, ids);
    assert_eq!(s.loss_mask, mask);
    assert_eq!(s.image_spans, vec![(image_start, 3)]);
    assert_eq!(s.audio_spans, vec![(audio_start, 2)]);
    assert_eq!(s.text_tokens, ids.len() - 5);
    assert_eq!(s.loss_tokens(), "A dog.".len() + 1 + "Yes.".len() + 1);
    check_invariants(&s, IMAGE, Some(AUDIO));
    assert_eq!(
        ByteTokenizer.decode(&s.ids).unwrap(),
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nSee <|image|><|image|><|image|> and hear \
         <|audio|><|audio|><|im_end|>\n<|im_start|>assistant\nA dog.<|im_end|>\n<|im_start|>user\nSure?<|im_end|>\n\
         <|im_start|>assistant\nYes.<|im_end|>\n"
    );
}

#[test]
fn loss_all_and_bos_eos_and_default_system() {
    let template = ChatTemplate {
        bos: Some("<|endoftext|>".into()),
        eos: Some("<|endoftext|>".into()),
        default_system: Some("Sys.".into()),
        ..ChatTemplate::default()
    };
    let msgs = vec![
        user(vec![Part::Image(0), text("Hi")]),
        Message::text(Role::Assistant, "Yo"),
    ];
    let s = tokenize_sample(&msgs, &template, &ByteTokenizer, &counts(&[2], &[])).unwrap();
    let expect = [
        vec![EOT, IM_START],
        bytes("system\nSys."),
        vec![IM_END],
        bytes("\n"),
        vec![IM_START],
        bytes("user\n"),
        vec![IMAGE, IMAGE],
        bytes("Hi"),
        vec![IM_END],
        bytes("\n"),
        vec![IM_START],
        bytes("assistant\nYo"),
        vec![IM_END],
        bytes("\n"),
        vec![EOT],
    ]
    .concat();
    assert_eq!(s.ids, expect);
    // Assistant-only: "Yo", its <|im_end|>, and the final EOS after an assistant turn.
    let on: Vec<usize> = (0..s.len()).filter(|&i| s.loss_mask[i] == 1).collect();
    let yo = expect.len() - 5;
    assert_eq!(on, vec![yo, yo + 1, yo + 2, expect.len() - 1]);

    // All: every token but the first and the placeholders.
    let all = ChatTemplate {
        loss: LossOn::All,
        ..template.clone()
    };
    let s2 = tokenize_sample(&msgs, &all, &ByteTokenizer, &counts(&[2], &[])).unwrap();
    assert_eq!(s2.ids, s.ids);
    let (start, len) = s2.image_spans[0];
    for (i, &m) in s2.loss_mask.iter().enumerate() {
        let expected = u8::from(i != 0 && !(start..start + len).contains(&i));
        assert_eq!(m, expected, "position {i}");
    }
    // All mode needs no assistant turn.
    let s3 = tokenize_sample(
        &[Message::text(Role::User, "raw text")],
        &all,
        &ByteTokenizer,
        &counts(&[], &[]),
    )
    .unwrap();
    assert_eq!(s3.loss_tokens(), s3.len() - 1);
}

#[test]
fn user_typed_special_tokens_stay_text() {
    // Byte tokenizer: the literal markers are bytes.
    let typed = "<|image|><|im_end|><|audio|>";
    let msgs = vec![
        user(vec![text(typed)]),
        Message::text(Role::Assistant, typed),
    ];
    let s = tokenize_sample(
        &msgs,
        &ChatTemplate::default(),
        &ByteTokenizer,
        &counts(&[], &[]),
    )
    .unwrap();
    assert!(s.image_spans.is_empty() && s.audio_spans.is_empty());
    assert!(!s.ids.contains(&IMAGE) && !s.ids.contains(&AUDIO));
    assert_eq!(
        s.ids.iter().filter(|&&i| i == IM_END).count(),
        2,
        "only the template's turn ends"
    );
    check_invariants(&s, IMAGE, Some(AUDIO));

    // HF tokenizer: a literal "<|image_pad|>" next to a real image gives one span only.
    let tok = tiny();
    let pad = tok.token_id("<|image_pad|>").unwrap();
    let im_end = tok.token_id("<|im_end|>").unwrap();
    let msgs = vec![
        user(vec![
            text("a literal <|image_pad|><|vision_start|> and <|im_end|>"),
            Part::Image(0),
        ]),
        Message::text(Role::Assistant, "<|image_pad|>"),
    ];
    let s = tokenize_sample(&msgs, &ChatTemplate::qwen2_vl(), &tok, &counts(&[5], &[])).unwrap();
    assert_eq!(s.image_spans.len(), 1);
    assert_eq!(s.ids.iter().filter(|&&i| i == pad).count(), 5);
    assert_eq!(s.ids.iter().filter(|&&i| i == im_end).count(), 2);
    check_invariants(&s, pad, None);
}

#[test]
fn text_encoding_to_a_placeholder_id_is_rejected() {
    // `<think>` is a non-special added token: it is matched in text, so using it as a
    // placeholder would let user text forge one.
    let tok = tiny();
    let template = ChatTemplate {
        image: Some(MediaFormat {
            pad: "<think>".into(),
            begin: None,
            end: None,
        }),
        ..ChatTemplate::qwen2_vl()
    };
    let msgs = vec![
        user(vec![text("x <think> y")]),
        Message::text(Role::Assistant, "ok"),
    ];
    let err = tokenize_sample(&msgs, &template, &tok, &counts(&[], &[])).unwrap_err();
    assert!(
        matches!(
            err,
            TokenizeError::ReservedTokenInText {
                message: 0,
                what: "image placeholder",
                ..
            }
        ),
        "{err}"
    );
    assert_eq!(
        err.to_string(),
        format!(
            "message 0: text encodes to the image placeholder token id {}",
            tok.token_id("<think>").unwrap()
        )
    );
    // Same for a default system prompt, caught when the template is compiled.
    let with_system = ChatTemplate {
        default_system: Some("<think>".into()),
        ..template
    };
    let err = CompiledTemplate::new(&with_system, &tok).unwrap_err();
    assert!(
        matches!(&err, TokenizeError::Template(m) if m.starts_with("default_system encodes to the image placeholder")),
        "{err}"
    );
}

#[test]
fn spans_and_markers_with_qwen_layout() {
    let tok = tiny();
    let id = |t: &str| tok.token_id(t).unwrap();
    let (vs, ve, pad, as_, ae, apad) = (
        id("<|vision_start|>"),
        id("<|vision_end|>"),
        id("<|image_pad|>"),
        id("<|audio_start|>"),
        id("<|audio_end|>"),
        id("<|audio_pad|>"),
    );
    let msgs = vec![
        user(vec![
            Part::Image(0),
            Part::Audio(0),
            text("and"),
            Part::Image(1),
        ]),
        Message::text(Role::Assistant, "fine"),
        user(vec![Part::Audio(1)]),
        Message::text(Role::Assistant, "ok"),
    ];
    let c = counts(&[4, 1], &[3, 2]);
    let s = tokenize_sample(&msgs, &ChatTemplate::qwen2_vl(), &tok, &c).unwrap();
    check_invariants(&s, pad, Some(apad));
    for (spans, (b, e), n) in [
        (&s.image_spans, (vs, ve), &c.images),
        (&s.audio_spans, (as_, ae), &c.audio),
    ] {
        assert_eq!(spans.len(), n.len());
        for (k, &(start, len)) in spans.iter().enumerate() {
            assert_eq!(len, n[k]);
            assert_eq!(s.ids[start - 1], b);
            assert_eq!(s.ids[start + len], e);
        }
    }
    // Spans in item order are in position order.
    assert!(s.image_spans[0].0 < s.audio_spans[0].0 && s.audio_spans[0].0 < s.image_spans[1].0);
    assert!(s.image_spans[1].0 < s.audio_spans[1].0);
    assert_eq!(s.text_tokens, s.len() - 10);
}

// ---------------------------------------------------------------- rejections

#[test]
fn rejections() {
    let t = ByteTokenizer;
    let tpl = ChatTemplate::default();
    let none = counts(&[], &[]);
    let a = Message::text(Role::Assistant, "ok");
    let run = |m: &[Message], c: &PlaceholderCounts| tokenize_sample(m, &tpl, &t, c).unwrap_err();

    assert!(matches!(run(&[], &none), TokenizeError::EmptyConversation));
    assert!(matches!(
        run(&[Message::text(Role::User, "hi")], &none),
        TokenizeError::NoAssistantTurn
    ));
    assert!(matches!(
        run(
            &[
                Message::text(Role::User, "hi"),
                Message::text(Role::System, "late"),
                a.clone(),
            ],
            &none
        ),
        TokenizeError::SystemNotFirst { index: 1 }
    ));
    // Image referenced with no count.
    let e = run(&[user(vec![Part::Image(0)]), a.clone()], &none);
    assert!(
        matches!(
            e,
            TokenizeError::MissingCount {
                message: 0,
                modality: Modality::Image,
                index: 0,
                given: 0
            }
        ),
        "{e}"
    );
    let e = run(&[user(vec![Part::Audio(0)]), a.clone()], &counts(&[], &[0]));
    assert!(
        matches!(
            e,
            TokenizeError::ZeroCount {
                modality: Modality::Audio,
                ..
            }
        ),
        "{e}"
    );
    // Out of order, twice, skipped.
    let e = run(
        &[user(vec![Part::Image(1), Part::Image(0)]), a.clone()],
        &counts(&[1, 1], &[]),
    );
    assert!(
        matches!(
            e,
            TokenizeError::MediaOrder {
                index: 1,
                expected: 0,
                ..
            }
        ),
        "{e}"
    );
    let e = run(
        &[user(vec![Part::Image(0), Part::Image(0)]), a.clone()],
        &counts(&[1, 1], &[]),
    );
    assert!(
        matches!(
            e,
            TokenizeError::MediaOrder {
                index: 0,
                expected: 1,
                ..
            }
        ),
        "{e}"
    );
    // A count for an item never referenced.
    let e = run(
        &[user(vec![text("no image")]), a.clone()],
        &counts(&[4], &[]),
    );
    assert!(
        matches!(
            e,
            TokenizeError::UnreferencedMedia {
                modality: Modality::Image,
                count: 1,
                referenced: 0
            }
        ),
        "{e}"
    );
    // Invalid roles.
    for bad in ["", "gpt", "User", "assistant ", "tool"] {
        assert!(
            matches!(bad.parse::<Role>(), Err(TokenizeError::InvalidRole { .. })),
            "{bad:?}"
        );
    }
    assert_eq!("assistant".parse::<Role>().unwrap(), Role::Assistant);
    // Messages name the culprit.
    let e = run(
        &[user(vec![text("x"), Part::Audio(2)]), a.clone()],
        &counts(&[], &[1]),
    );
    assert_eq!(
        e.to_string(),
        "message 0: audio clip 2 referenced out of order (expected audio clip 0; each is referenced once, in order)"
    );
}

#[test]
fn template_resolution_errors() {
    let tok = tiny();
    // Text-only data works with a template whose audio token the tokenizer lacks...
    let tpl = ChatTemplate {
        audio: Some(MediaFormat {
            pad: "<|AUDIO|>".into(),
            begin: None,
            end: None,
        }),
        ..ChatTemplate::qwen2_vl()
    };
    let c = CompiledTemplate::new(&tpl, &tok).unwrap();
    assert!(c.media_error(Modality::Image).is_none());
    let why = c.media_error(Modality::Audio).unwrap();
    assert!(why.contains("<|AUDIO|>"), "{why}");
    let ok = [user(vec![text("hi")]), Message::text(Role::Assistant, "ok")];
    c.tokenize(&ok, &counts(&[], &[])).unwrap();
    // ... and a sample with a clip is rejected with the reason.
    let clip = [
        user(vec![Part::Audio(0)]),
        Message::text(Role::Assistant, "ok"),
    ];
    let e = c.tokenize(&clip, &counts(&[], &[2])).unwrap_err();
    assert!(
        matches!(
            e,
            TokenizeError::NoPlaceholder {
                modality: Modality::Audio,
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("<|AUDIO|>"), "{e}");
    // No audio format at all.
    let tpl = ChatTemplate {
        audio: None,
        ..ChatTemplate::default()
    };
    let e = tokenize_sample(&clip, &tpl, &ByteTokenizer, &counts(&[], &[2])).unwrap_err();
    assert!(e.to_string().contains("no audio placeholder"), "{e}");
    // BOS / EOS must be single tokens.
    let tpl = ChatTemplate {
        bos: Some("<s>".into()),
        ..ChatTemplate::default()
    };
    let e = CompiledTemplate::new(&tpl, &ByteTokenizer).unwrap_err();
    assert!(matches!(e, TokenizeError::UnknownToken { .. }), "{e}");
    // Image and audio sharing a pad token.
    let tpl = ChatTemplate {
        audio: tpl.image.clone(),
        ..ChatTemplate::default()
    };
    assert!(matches!(
        CompiledTemplate::new(&tpl, &ByteTokenizer),
        Err(TokenizeError::Template(_))
    ));
}

#[test]
fn template_serde() {
    // Partial configs keep the defaults; unknown keys are rejected.
    let tpl: ChatTemplate = serde_json::from_str(
        r#"{"loss": "all", "image": {"pad": "<|image_pad|>", "begin": "<|vision_start|>", "end": "<|vision_end|>"},
            "assistant": {"prefix": "<|im_start|>assistant\n", "suffix": "<|im_end|>"}}"#,
    )
    .unwrap();
    assert_eq!(tpl.loss, LossOn::All);
    assert_eq!(tpl.user, RoleFormat::chatml(Role::User));
    assert_eq!(tpl.assistant.separator, "");
    assert_eq!(tpl.image, ChatTemplate::qwen2_vl().image);
    assert_eq!(tpl.audio, ChatTemplate::default().audio);
    let back: ChatTemplate = serde_json::from_str(&serde_json::to_string(&tpl).unwrap()).unwrap();
    assert_eq!(back, tpl);
    assert!(serde_json::from_str::<ChatTemplate>(r#"{"los": "all"}"#).is_err());
    assert!(serde_json::from_str::<ChatTemplate>(r#"{"image": {"pad": "x", "size": 3}}"#).is_err());
    assert!(serde_json::from_str::<ChatTemplate>(r#"{"loss": "assistant"}"#).is_err());
    let d: ChatTemplate = serde_json::from_str("{}").unwrap();
    assert_eq!(d, ChatTemplate::default());
}

// ---------------------------------------------------------------- placeholder counts

#[test]
fn vision_token_counts() {
    assert_eq!(vision_tokens(224, 224, 14, 1, false).unwrap(), 256); // CLIP ViT-L/14-224
    assert_eq!(vision_tokens(336, 336, 14, 1, false).unwrap(), 576); // LLaVA-1.5
    assert_eq!(vision_tokens(336, 336, 14, 1, true).unwrap(), 577);
    assert_eq!(vision_tokens(448, 224, 14, 2, false).unwrap(), 16 * 8); // Qwen2-VL 2x2 merge
    assert_eq!(vision_tokens(384, 384, 16, 1, false).unwrap(), 576); // SigLIP-384/16
    for (h, w, p, m) in [
        (225, 224, 14, 1),
        (224, 224, 14, 3),
        (0, 224, 14, 1),
        (224, 224, 0, 1),
        (28, 28, 14, 0),
    ] {
        let e = vision_tokens(h, w, p, m, false).unwrap_err();
        assert!(
            matches!(e, TokenizeError::Geometry { .. }),
            "{h} {w} {p} {m}: {e}"
        );
    }
    assert!(vision_tokens(usize::MAX, usize::MAX, 1, 1, false).is_err());
}

#[test]
fn audio_token_counts() {
    // Reference: a kernel-3, padding-1 convolution of stride s keeps floor((F - 1) / s) + 1
    // frames, then groups of `pool` frames, the last one padded.
    for f in 1usize..400 {
        for s in 1..4 {
            for pool in 1..6 {
                let conv = (f + 2 - 3) / s + 1;
                let expect: usize = conv / pool + usize::from(conv % pool != 0);
                assert_eq!(audio_tokens(f, s, pool).unwrap(), expect, "{f} {s} {pool}");
            }
        }
    }
    assert_eq!(audio_tokens(3000, 2, 1).unwrap(), 1500); // Whisper, 30 s
    assert_eq!(audio_tokens(3000, 2, 4).unwrap(), 375);
    assert!(audio_tokens(0, 2, 1).is_err());
    assert!(audio_tokens(10, 0, 1).is_err());
    assert!(audio_tokens(10, 2, 0).is_err());
}

// ---------------------------------------------------------------- HF tokenizers vs Python

/// Compares encodings with a reference JSON written by
/// `tools/fixtures/make_tokenizer_fixture.py`.
fn compare_with_reference(tok: &HfTokenizer, reference: &Value) {
    for (t, id) in reference["special_ids"].as_object().unwrap() {
        assert_eq!(tok.token_id(t), Some(id.as_u64().unwrap() as u32), "{t}");
    }
    assert_eq!(
        tok.vocab_size() as u64,
        reference["vocab_size_with_added"].as_u64().unwrap()
    );
    for case in reference["plain"].as_array().unwrap() {
        let s = case["text"].as_str().unwrap();
        let ids = tok.encode(s).unwrap();
        assert_eq!(ids, ids_of(&case["ids"]), "{s:?}");
        // Byte-level BPE round-trips the (NFC-normalized) text.
        if !s.contains('\u{301}') {
            assert_eq!(tok.decode(&ids).unwrap(), s);
        }
    }
    // Chats: Braid's template == Python encoding the rendered string (specials split).
    let tpl = ChatTemplate::qwen2_vl();
    let chats: Vec<(&str, Vec<Message>, PlaceholderCounts)> = vec![
        (
            "text_only",
            vec![
                Message::text(Role::System, "You are a helpful assistant."),
                Message::text(Role::User, "What is 2+2?"),
                Message::text(Role::Assistant, "2+2 = 4."),
            ],
            counts(&[], &[]),
        ),
        (
            "with_image",
            vec![
                user(vec![Part::Image(0), text("Describe the image.")]),
                Message::text(Role::Assistant, "There are three red circles."),
            ],
            counts(&[4], &[]),
        ),
    ];
    let im_end = tok.token_id("<|im_end|>").unwrap();
    for (name, msgs, c) in chats {
        let case = reference["chat"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["name"] == name)
            .unwrap();
        let s = tokenize_sample(&msgs, &tpl, tok, &c).unwrap();
        assert_eq!(s.ids, ids_of(&case["ids"]), "{name}");
        assert_eq!(tok.decode(&s.ids).unwrap(), case["text"].as_str().unwrap());
        // The mask is exactly the answer and its <|im_end|>.
        let answer = msgs.last().map(|m| match &m.parts[0] {
            Part::Text(t) => tok.encode(t).unwrap(),
            _ => unreachable!(),
        });
        let mut want = answer.unwrap();
        want.push(im_end);
        let masked: Vec<u32> = s
            .ids
            .iter()
            .zip(&s.loss_mask)
            .filter(|p| *p.1 == 1)
            .map(|p| *p.0)
            .collect();
        assert_eq!(masked, want, "{name}");
        check_invariants(&s, tok.token_id("<|image_pad|>").unwrap(), None);
    }
}

#[test]
fn tiny_bpe_matches_python_tokenizers() {
    let tok = tiny();
    compare_with_reference(&tok, &json("tiny_bpe_expected.json"));
    // Special tokens are split out of template strings only.
    assert_eq!(tok.special_tokens().len(), 12);
}

#[test]
fn qwen3_matches_python_tokenizers_when_present() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../shared/data/tokenizers/qwen3/tokenizer.json");
    let reference = json("qwen3_expected.json");
    let Ok(meta) = std::fs::metadata(&path) else {
        eprintln!(
            "SKIPPED: {} not found (a copy of shared/ beside the repo holds it)",
            path.display()
        );
        return;
    };
    if meta.len() != reference["file_bytes"].as_u64().unwrap() {
        eprintln!(
            "SKIPPED: {} is not the file the reference was computed on",
            path.display()
        );
        return;
    }
    let t0 = Instant::now();
    let tok = HfTokenizer::from_file(&path).unwrap();
    eprintln!(
        "qwen3 tokenizer.json loaded in {:.0} ms",
        t0.elapsed().as_secs_f64() * 1e3
    );
    compare_with_reference(&tok, &reference);
    // Qwen3 has no audio tokens: text and images work, a clip is a clear reject.
    let c = CompiledTemplate::new(&ChatTemplate::qwen2_vl(), &tok).unwrap();
    let why = c.media_error(Modality::Audio).unwrap();
    assert!(
        why.contains("<|audio_pad|>") && why.contains("not a single token"),
        "{why}"
    );
    assert_eq!(c.placeholder_id(Modality::Image), Some(151655));
    long_text_timing("qwen3", &tok);
}

#[test]
fn bad_tokenizer_files_are_errors() {
    for bad in [
        &b""[..],
        b"{",
        b"{}",
        b"[1,2,3]",
        b"\xff\xfe garbage",
        br#"{"model": {"type": "BPE"}}"#,
    ] {
        let e = HfTokenizer::from_bytes(bad, "bad.json").unwrap_err();
        assert!(matches!(e, TokenizeError::Load { .. }), "{e}");
        assert!(e.to_string().starts_with("tokenizer bad.json"), "{e}");
    }
    // A truncated copy of the real fixture.
    let good = std::fs::read(fixture("tiny_bpe.json")).unwrap();
    for cut in [1, good.len() / 3, good.len() / 2, good.len() - 2] {
        assert!(HfTokenizer::from_bytes(&good[..cut], "cut").is_err());
    }
    assert!(matches!(
        HfTokenizer::from_file("/nonexistent/tokenizer.json"),
        Err(TokenizeError::Load { .. })
    ));
    assert!(matches!(
        tiny().decode(&[1, 1_000_000]),
        Err(TokenizeError::InvalidId { id: 1_000_000, .. })
    ));
}

/// Random text made of fragments that stress the template: special-token pieces,
/// unicode, control characters. No panic; every result satisfies the invariants.
#[test]
fn garbage_text_never_breaks_the_layout() {
    let tok = tiny();
    let pad = tok.token_id("<|image_pad|>").unwrap();
    let frags = [
        "<|",
        "|>",
        "<|image_pad|>",
        "<|im_end|>",
        "im_start",
        "\n",
        " ",
        "\t",
        "é",
        "e\u{301}",
        "🎉",
        "\u{200d}",
        "\u{0}",
        "東",
        "<think>",
        "'s",
        "123",
        "\r\n",
        "\u{FFFF}",
        "x",
    ];
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = |n: usize| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state % n as u64) as usize
    };
    let tpl = ChatTemplate::qwen2_vl();
    let c = CompiledTemplate::new(&tpl, &tok).unwrap();
    for _ in 0..200 {
        let mut s = String::new();
        for _ in 0..next(30) {
            s.push_str(frags[next(frags.len())]);
        }
        let msgs = vec![
            user(vec![text(&s), Part::Image(0), text(&s)]),
            Message::text(Role::Assistant, s.clone()),
        ];
        let out = c.tokenize(&msgs, &counts(&[3], &[])).unwrap();
        check_invariants(&out, pad, None);
        assert_eq!(out.image_spans.len(), 1);
        let b = tokenize_sample(&msgs[..1], &tpl, &ByteTokenizer, &counts(&[], &[]));
        assert!(b.is_err());
    }
}

// ---------------------------------------------------------------- long inputs

fn long_text_timing(name: &str, tok: &dyn Tokenizer) {
    let unit = "The quick brown fox jumps over the lazy dog; Grüße aus 東京 🎉 1234.\n";
    let text = unit.repeat((1 << 20) / unit.len() + 1);
    let msgs = vec![
        Message::text(Role::User, "Summarize."),
        Message::text(Role::Assistant, text.clone()),
    ];
    let t0 = Instant::now();
    let s = tokenize_sample(&msgs, &ChatTemplate::default(), tok, &counts(&[], &[])).unwrap();
    let dt = t0.elapsed().as_secs_f64();
    eprintln!(
        "{name}: {:.2} MB of text -> {} tokens in {:.0} ms ({:.1} MB/s)",
        text.len() as f64 / 1e6,
        s.len(),
        dt * 1e3,
        text.len() as f64 / 1e6 / dt
    );
    assert!(s.loss_tokens() > 1000);
    // Generous bound (shared 2-core CI machine); the figures are printed above.
    assert!(dt < 10.0, "{name}: 1 MB took {dt:.1} s");
}

#[test]
fn long_inputs() {
    long_text_timing("byte", &ByteTokenizer);
    long_text_timing("tiny_bpe", &tiny());
}
