"""Print the config key reference as a Markdown table (pasted into README.md; a test keeps them in sync)."""

from trainer.config import field_docs


def table() -> str:
    lines = ["| key | default | meaning |", "|---|---|---|"]
    for key, default, doc in field_docs():
        lines.append(f"| `{key}` | `{default}` | {doc.replace('|', '/')} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())
