//! Tokenization rejections: every bad sample, template resolution errors and template serde.
#![allow(clippy::unwrap_used)]

mod common;

use braid_dataloader::tokenize::{
    ByteTokenizer, ChatTemplate, CompiledTemplate, LossOn, MediaFormat, Message, Modality, Part,
    PlaceholderCounts, Role, RoleFormat, TokenizeError, tokenize_sample,
};

use common::tokenize_util::*;

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
