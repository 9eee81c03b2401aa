//! How the interface is described: the code sets (`device_codes!`) and the argument
//! structs (`device_struct!`) that `abi` declares, with the C types and layouts the
//! prelude and the tests are made from.

use std::fmt::Write as _;

/// A set of codes the kernels switch on: a Rust enum whose variants carry their value and
/// their C name, from which the prelude's `#define`s are made.
macro_rules! device_codes {
    ($(#[$meta:meta])* enum $name:ident {
        $($(#[$vmeta:meta])* $variant:ident = $value:literal => $c_name:ident,)*
    }) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        #[repr(i64)]
        pub(crate) enum $name {
            $($(#[$vmeta])* $variant = $value,)*
        }

        impl $name {
            /// Every code, in order.
            pub(crate) const ALL: &[$name] = &[$($name::$variant,)*];

            /// The value the kernels see.
            pub(crate) fn code(self) -> i64 {
                self as i64
            }

            /// The name the kernels use.
            pub(crate) fn c_name(self) -> &'static str {
                match self {
                    $($name::$variant => stringify!($c_name),)*
                }
            }

            fn defines() -> impl Iterator<Item = (&'static str, i64)> {
                Self::ALL.iter().map(|c| (c.c_name(), c.code()))
            }
        }
    };
}

/// A type the argument structs are made of, by its C name.
pub(crate) trait CType {
    /// The type's name in the kernels' source.
    const C_NAME: &'static str;
}

/// A field's type as C declares it: a [`CType`], or an array of one.
pub(crate) trait FieldType {
    /// The element's C type.
    const C_TYPE: &'static str;
    /// The array length, `None` for a single value.
    const LEN: Option<usize>;
}

macro_rules! scalar_c_types {
    ($($ty:ty => $c:literal),*) => {$(
        impl CType for $ty {
            const C_NAME: &'static str = $c;
        }
        impl FieldType for $ty {
            const C_TYPE: &'static str = $c;
            const LEN: Option<usize> = None;
        }
    )*};
}

scalar_c_types!(i64 => "i64", u64 => "u64", f64 => "double");

impl<T: CType, const N: usize> FieldType for [T; N] {
    const C_TYPE: &'static str = T::C_NAME;
    const LEN: Option<usize> = Some(N);
}

/// One field of an argument struct: its C declaration and its offset in the Rust struct.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct FieldLayout {
    pub name: &'static str,
    pub c_type: &'static str,
    pub len: Option<usize>,
    pub offset: usize,
}

/// An argument struct as Rust lays it out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct StructLayout {
    pub name: &'static str,
    pub size: usize,
    pub fields: Vec<FieldLayout>,
}

impl StructLayout {
    /// The C definition the prelude gives.
    pub(crate) fn declaration(&self) -> String {
        let mut out = format!("struct {} {{\n", self.name);
        for f in &self.fields {
            let _ = match f.len {
                Some(n) => writeln!(out, "    {} {}[{n}];", f.c_type, f.name),
                None => writeln!(out, "    {} {};", f.c_type, f.name),
            };
        }
        out.push_str("};\n");
        out
    }
}

/// A struct of the interface, described for the prelude and the tests.
pub(crate) trait DeviceStruct: CType {
    /// Its fields in order, with their Rust offsets.
    fn layout() -> StructLayout;
}

/// An argument struct, defining both the Rust type and its description.
macro_rules! device_struct {
    ($(#[$meta:meta])* struct $name:ident {
        $($(#[$fmeta:meta])* $field:ident: $ty:ty,)*
    }) => {
        $(#[$meta])*
        #[repr(C)]
        #[derive(Debug, Clone, Copy, PartialEq)]
        pub(crate) struct $name {
            $($(#[$fmeta])* pub $field: $ty,)*
        }

        impl CType for $name {
            const C_NAME: &'static str = stringify!($name);
        }

        impl FieldType for $name {
            const C_TYPE: &'static str = stringify!($name);
            const LEN: Option<usize> = None;
        }

        impl DeviceStruct for $name {
            fn layout() -> StructLayout {
                StructLayout {
                    name: stringify!($name),
                    size: std::mem::size_of::<$name>(),
                    fields: vec![$(FieldLayout {
                        name: stringify!($field),
                        c_type: <$ty as FieldType>::C_TYPE,
                        len: <$ty as FieldType>::LEN,
                        offset: std::mem::offset_of!($name, $field),
                    },)*],
                }
            }
        }
    };
}
