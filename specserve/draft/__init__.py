"""Draft-side algorithms: chain proposals, EAGLE-2 dynamic trees and DDD's dynamic depth (no model code)."""
