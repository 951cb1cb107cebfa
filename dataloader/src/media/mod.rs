pub mod audio;
pub mod mel;
