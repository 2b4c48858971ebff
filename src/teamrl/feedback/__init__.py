"""teamrl.feedback."""

from teamrl.feedback.static import (
    StaticReport,
    SyntaxIssue,
    UndefinedName,
    analyze_code,
    check_syntax,
    find_undefined_names,
    format_test_failures,
)

__all__ = [
    "StaticReport",
    "SyntaxIssue",
    "UndefinedName",
    "analyze_code",
    "check_syntax",
    "find_undefined_names",
    "format_test_failures",
]
