"""``kimi-quant publish DIR --push-to-hub ORG/NAME [--public] [--include PATTERN] [--hub-revision BRANCH] [--force]``
(registered by kimi_quant.cli)."""

from __future__ import annotations

import click

from ..options import old_name, takes_old_name


@click.command("publish", short_help="Upload a verified output with a model card.")
@click.argument("output", type=click.Path(file_okay=False, path_type=str))
@click.option("--push-to-hub", "repo_id", metavar="ORG/NAME", callback=takes_old_name,
              help="Hub repo to create (if needed) and upload to.  [required]")
@old_name("--repo-id", "repo_id", "--push-to-hub")
@click.option("--private/--public", default=True, show_default="private",
              help="Create the repo private (the default) or public; an existing repo keeps its visibility.")
@click.option("--include", "include", multiple=True, metavar="PATTERN",
              help="Also upload files matching PATTERN (fnmatch on the path in OUTPUT) that kimi-quant did not "
                   "write; without it only the conversion's own files are uploaded, and the others are named.")
@click.option("--hub-revision", "branch", default=None, metavar="BRANCH", callback=takes_old_name,
              help="Upload to this branch (created from main if missing).")
@old_name("--revision", "branch", "--hub-revision")
@old_name("--branch", "branch", "--hub-revision")
@click.option("--force", is_flag=True, help="Publish even though the output's validation failed (--max-ppl-increase); "
                                            "the card shows the numbers.")
@click.option("--token", default=None, envvar="HF_TOKEN", show_envvar=True, help="Hub token with write access.")
@click.option("--message", default=None, help="Commit message.")
@click.option("--no-card", is_flag=True, help="Do not generate README.md (the model card).")
def publish(output, repo_id, private, include, branch, token, message, no_card, force):
    """Upload a verified conversion OUTPUT to the hub (HF_ENDPOINT selects the server).

    Uploads only what the conversion wrote (shards, index, description, config, card, provenance, validation
    report, the source's small files it copied); anything else in OUTPUT is named and left out unless
    --include names it. A new repo is private unless --public.
    Refuses an incomplete or damaged output, and one whose validation failed unless --force. Re-running uploads only what the remote lacks. The
    branch ends up holding exactly this output and its card: files of an earlier conversion are
    deleted in the same single commit (dot-files such as .gitattributes are kept).
    """
    from .publish import publish as do_publish

    if not repo_id:  # not click's required=True: an old spelling may give it
        raise click.UsageError("Missing option '--push-to-hub'.")

    res = do_publish(output, repo_id, private=private, branch=branch, token=token, commit_message=message,
                     card=not no_card, echo=lambda m: click.echo(m, err=True), force=force,
                     include=include)
    if res.uploaded or res.deleted:
        removed = f"removed {len(res.deleted)} file(s) not in this output; " if res.deleted else ""
        click.echo(f"published {len(res.uploaded)} file(s) ({res.uploaded_bytes / 1e9:.2f} GB) to "
                   f"{res.url} @ {res.branch} ({(res.commit or '')[:12]}); {removed}{len(res.skipped)} already there")
    else:
        click.echo(f"nothing to upload: {res.url} @ {res.branch} already has all {len(res.skipped)} file(s)")
