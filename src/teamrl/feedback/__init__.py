"""teamrl.feedback."""

from teamrl.feedback.static import (
    AnalysisFailure,
    StaticReport,
    SyntaxIssue,
    UndefinedName,
    analyze_code,
    check_syntax,
    find_undefined_names,
    format_test_failures,
    parse_code,
)

__all__ = [
    "AnalysisFailure",
    "StaticReport",
    "SyntaxIssue",
    "UndefinedName",
    "analyze_code",
    "check_syntax",
    "find_undefined_names",
    "format_test_failures",
    "parse_code",
]
